"""The pool's shard affinity at 10^6 shards: what it models of each producer's cache, and each pick, cost
O(producers x capacity), never O(shards) per producer or per split (issue 41: a bool per shard per producer was
1 GB at 10^6 shards x 1,024 producers). Bounds on memory, never on time."""

from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings, strategies as st

from stoker.consumer.exact.pool.pool_member import ShardChoice
from stoker.consumer.exact.pool.split_plan import SchedulerPlan
from stoker.protocol.input_state import RangeProgress, StreamKey

SHARDS, SHARD_RECORDS, PRODUCERS, CAPACITY = 10**6, 10_000, 64, 8


def _pool() -> tuple[StreamKey, object]:
    key = StreamKey.parse(f"splits:{SHARDS * SHARD_RECORDS}:7:{SHARD_RECORDS}x1:o2")
    progress = RangeProgress(key.records)
    return key, SchedulerPlan(256, 8).scheduler(key, progress, lambda e: progress.advance(e + 1), None)


def test_a_million_shards_cost_the_model_of_each_cache_its_capacity_not_the_shards():
    key, scheduler = _pool()
    tracemalloc.start()
    try:
        for p in range(PRODUCERS):
            scheduler.holdings.note(p, CAPACITY, list(range(p * CAPACITY, (p + 1) * CAPACITY)))
        handed = [scheduler.top_up(p, now=0.0) for p in range(PRODUCERS)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(handed)
    # A bool per shard per producer alone is 64 MB here, and one mask of the shards nobody holds 1 MB a pick.
    assert peak < 2 * 2**20, f"{peak / 2**20:.1f} MiB for {PRODUCERS} producers' caches and their first splits"
    assert len(scheduler.holdings.holders) <= PRODUCERS * CAPACITY


def test_a_producer_is_handed_a_split_of_a_shard_it_holds_among_a_million():
    key, scheduler = _pool()
    order = key.lazy_order()
    wanted = int(order.shard_at(0, np.array([key.records - 1]))[0])  # the last window's shard: far from the cursor
    scheduler.holdings.note(0, CAPACITY, [wanted])
    item = scheduler.top_up(0, now=0.0)[0]
    assert int(order.shard_at(item.epoch, np.array([item.start]))[0]) == wanted


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 40), max_size=12), st.lists(st.integers(0, 40), max_size=30), st.booleans())
def test_a_shard_choice_holds_what_a_set_holds(numbers, asked, exclude):
    choice = ShardChoice(numbers, exclude=exclude)
    expected = [(s in numbers) != exclude for s in asked]
    assert choice.holds(np.array(asked, np.int64)).tolist() == expected
    assert choice.mask(41).tolist() == [(s in numbers) != exclude for s in range(41)]
