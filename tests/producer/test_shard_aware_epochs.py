"""Shard-aware epochs of an elastic pool: the two-level order both sides compute, and the trainer handing each split
to a producer whose cache holds its shard (consumer/exact/pool/shard_affinity.py).

The pool runs in-process here: a real ``SplitScheduler`` hands out work items, simulated producers serve them (the
records of the items, computed from the order as a real ``PoolPolicy`` does) through a least-recently-used cache
of a quarter of the shards, counting every shard they would fetch. The same pool with the same order but no cache
reported is the baseline that ignores shards. The real producers, S3 server and cache are in
tests/dataset/test_object_storage.py and benchmarks/shard_fetches.py.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from functools import partial

import numpy as np
import pytest

from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.pool.split_scheduler import SplitScheduler
from stoker.protocol.exact_messages import ProtocolError, Status, decode_status, encode_status
from stoker.protocol.input_state import InputState, StreamKey, epoch_order
from stoker.producer.dataset.sources.manifest import Manifest, ShardInfo
from stoker.producer.dataset.sources.lmdb_format import DatasetMeta, FieldKind
from stoker.producer.serve.sharding import ShardSpec, layout_block
from stoker.producer.serve.policies.pool import PoolPolicy

import msgpack


def test_the_two_level_order_is_a_permutation_shard_by_shard_and_the_flat_order_is_unchanged():
    records, block = 1000, 64
    order = epoch_order(np.arange(records), 3, 2, block=block)
    assert sorted(order.tolist()) == list(range(records))
    shards = order // block
    runs = 1 + int((np.diff(shards) != 0).sum())
    assert runs == -(-records // block)  # each shard's records are one run of positions
    assert not np.array_equal(order, epoch_order(np.arange(records), 3, 3, block=block))  # epochs differ
    assert np.array_equal(order, epoch_order(np.arange(records), 3, 2, block=block))  # and are reproducible
    within = order[shards == shards[0]]
    assert not np.array_equal(within, np.sort(within))  # records are shuffled within their shard
    # Windows of 3 shards (of 15 whole ones): each run of 3 x 64 positions holds 3 shards, mixed.
    windowed = epoch_order(np.arange(960), 3, 2, block=block, window=3) // block
    runs = [windowed[i:i + 3 * block] for i in range(0, 960, 3 * block)]
    assert all(len(set(r.tolist())) == 3 and (np.diff(r) != 0).sum() > 2 for r in runs)
    # Keys without a layout order as every release before: one PCG64 permutation.
    assert np.array_equal(epoch_order(np.arange(records), 3, 2),
                          np.random.default_rng([3, 2]).permutation(np.arange(records)))


def test_a_pool_key_carries_its_layout_and_bad_layouts_are_refused():
    key = StreamKey.parse("splits:1000:3:64x2")
    assert (key.block, key.window, key.shards, str(key)) == (64, 2, 16, "splits:1000:3:64x2")
    assert StreamKey.parse("splits:1000:3") == StreamKey(0, 1, 1000, 3, splits=True)
    for bad in ("splits:1000:3:0x1", "splits:1000:3:64x0", "splits:1000:3:64x999999", "splits:1000:3:64",
                "0/2:1000:3:0x1"):
        with pytest.raises(ValueError):
            StreamKey.parse(bad)
    assert np.array_equal(key.order(1), epoch_order(np.arange(1000), 3, 1, block=64, window=2))


@pytest.mark.parametrize("count", [1, 2, 3, 5, 16])
def test_fixed_shards_of_a_layout_are_whole_dataset_shards_disjoint_and_complete(count):
    keys = [StreamKey.parse(f"{i}/{count}:1000:3:64x1") for i in range(count)]
    served = [k.stream_records() for k in keys]
    assert sorted(np.concatenate(served).tolist()) == list(range(1000))
    for key, records in zip(keys, served):
        assert len(records) == key.size and str(key) == f"{key.index}/{count}:1000:3:64x1"
        assert set((records // 64).tolist()) == set(range(key.index, 16, count))  # whole shards j % N == I
        assert np.array_equal(key.local(records), np.arange(key.size))
        assert key.owns(np.arange(1000)).sum() == key.size
        assert sorted(key.order(2).tolist()) == records.tolist()
        if count > 1:
            with pytest.raises(ValueError):
                key.local(np.setdiff1d(np.arange(1000), records)[:1])
    # Without a layout a fixed shard is every N-th record, as before.
    last = count - 1
    assert StreamKey.parse(f"{last}/{count}:1000:3").stream_records().tolist() == list(range(last, 1000, count))


def test_a_status_carries_the_cache_and_bounds_it():
    status = Status("splits:1000:3:64x1", "p1", 0, 2, False, cache=4, held=[3, 1])
    body = msgpack.unpackb(encode_status(status))
    assert decode_status(body) == status
    assert "cache" not in msgpack.unpackb(encode_status(Status("splits:1000:3", "p1", 0, 2, False)))
    for bad in ({"cache": 0}, {"cache": 4, "held": list(range(257))}, {"cache": 4, "held": [-1]},
                {"cache": 4, "held": "x"}):
        with pytest.raises(ProtocolError):
            decode_status({**body, **bad})


def _manifest(counts):
    shards, first = [], 0
    for i, n in enumerate(counts):
        shards.append(ShardInfo(f"shard-{i:05d}", first, n, 100, "0" * 64))
        first += n
    return Manifest(DatasetMeta(count=first, fields={"label": FieldKind.parse("int")}), tuple(shards))


def test_the_layout_is_the_shards_record_count_and_uneven_shards_go_by_blocks_of_the_mean_shard(caplog):
    caplog.set_level(logging.INFO, logger="stoker.producer")
    auto = ShardSpec(auto=True)
    assert layout_block(auto, 1, _manifest([50, 50, 20])) == 50
    assert layout_block(ShardSpec(1, 3), 1, _manifest([50, 50, 20])) == 50  # fixed shards: whole dataset shards
    assert layout_block(auto, 0, _manifest([50, 50, 20])) == 0  # --shuffle-window 0
    assert layout_block(auto, 1, _manifest([50])) == 0 and layout_block(auto, 1, None) == 0
    assert layout_block(auto, 1, _manifest([50, 40, 50])) == 47  # 140 records / 3 shards, rounded up
    assert "different numbers of records" in caplog.text and "blocks of 47 records" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert layout_block(ShardSpec(2, 3), 1, _manifest([50, 40, 50])) == 47  # 3 blocks: a fixed shard each
    with pytest.raises(ValueError, match="has 3 blocks of 3 records .* 1 of 4 producers would serve nothing"):
        layout_block(ShardSpec(3, 4), 1, _manifest([1, 1, 1, 6]))  # 4 shards, but 9 records make 3 blocks
    with pytest.raises(ValueError, match="shuffle-window"):
        layout_block(auto, -1, None)
    with pytest.raises(ValueError, match="would serve nothing"):
        layout_block(ShardSpec(0, 4), 1, _manifest([50, 50, 20]))


class _Producer:
    """A pool producer: its split server computes the records of the work it gets; its cache is an LRU of
    ``capacity`` shards that counts fetches."""

    def __init__(self, key: StreamKey, capacity: int) -> None:
        self.key, self.capacity = key, capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.fetches = 0
        self.items: list = []

    def serve_one(self) -> tuple[np.ndarray, np.ndarray]:
        item = self.items.pop(0)
        records = self.key.order(item.epoch)[item.start:item.end]
        keep = np.ones(len(records), bool)
        keep[np.asarray(item.skip, np.int64)] = False
        records = records[keep]
        for shard in (records // self.key.block).tolist():
            if shard in self.cache:
                self.cache.move_to_end(shard)
            else:
                self.fetches += 1
                self.cache[shard] = None
                while len(self.cache) > self.capacity:
                    self.cache.popitem(last=False)
        return np.full(len(records), item.epoch), records


def _completes(state, key):
    """What a scheduler reports complete, written as the trainer writes it: by its ledger, the state's one writer."""
    return partial(ConsumedLedger("trainer", state).complete_pool_epoch, str(key))


def _run_pool(report_cache: bool, producers=4, shards=32, block=96, epochs=4, split=32, seed=5):
    key = StreamKey(0, 1, shards * block - 17, seed, splits=True, block=block, window=1)
    state = InputState()
    sched = SplitScheduler(key, state.progress(str(key)), _completes(state, key), epochs, split, ahead=2,
                           stall_after=None)
    pool = [_Producer(key, shards // producers) for _ in range(producers)]
    if report_cache:
        for i, p in enumerate(pool):
            sched.holdings.note(i, p.capacity, [])
    seen: Counter = Counter()
    rng = np.random.default_rng(0)
    for _ in range(100_000):
        if sched.finished:
            break
        for i in sched.wants_work():
            pool[i].items += sched.top_up(i)
        for i in range(producers):
            if not pool[i].items:
                pool[i].items += sched.top_up(i)
        busy = [i for i in range(producers) if pool[i].items]
        i = busy[int(rng.integers(len(busy)))]  # producers go at random paces
        e, r = pool[i].serve_one()
        keep = sched.arrived(e, r, np.ones(len(r), bool), producer=i)
        seen.update(zip(e[keep].tolist(), r[keep].tolist()))
        sched.consumed(e[keep], r[keep])
        state.mark(str(key), e[keep], r[keep])
    assert sched.finished
    twice = sum(1 for n in seen.values() if n > 1)
    never = sum(1 for e in range(epochs) for r in range(key.records) if (e, r) not in seen)
    return sum(p.fetches for p in pool), twice, never


def test_splits_go_to_the_producer_that_holds_their_shard_many_times_fewer_fetches_and_still_exact():
    aware, twice, never = _run_pool(report_cache=True)
    blind, twice_blind, never_blind = _run_pool(report_cache=False)
    assert (twice, never, twice_blind, never_blind) == (0, 0, 0, 0)
    shards, epochs = 32, 4
    assert aware < 0.5 * shards * epochs  # mostly each producer's own quarter, fetched about once
    assert blind >= 3 * aware, (aware, blind)


def test_a_joining_producer_takes_the_splits_of_the_shards_its_cache_holds():
    key = StreamKey(0, 1, 16 * 50, 1, splits=True, block=50, window=1)
    state = InputState()
    sched = SplitScheduler(key, state.progress(str(key)), _completes(state, key), 1, 10, ahead=3, stall_after=None)
    sched.holdings.note(0, 4, [])
    sched.holdings.note(1, 4, [7, 11])
    items = sched.top_up(1)  # 3 splits of 10 records: each within one shard (a window of one), 7's or 11's
    shards = [set((key.order(0)[item.start:item.end] // 50).tolist()) for item in items]
    assert len(items) == 3 and all(len(s) == 1 and s <= {7, 11} for s in shards), shards
    # Producer 0 holds nothing: it takes shards nobody holds, never 7 or 11 while 1 holds them.
    mine = {int(s) for item in sched.top_up(0) for s in (key.order(0)[item.start + 5:item.start + 6] // 50).tolist()}
    assert not mine & {7, 11}


def test_a_pool_producer_says_its_cache_in_its_status_only_for_a_layout():
    class Cache:
        def holdings(self):
            return 4, [2, 3]

    key = StreamKey.parse("splits:800:1:50x1")
    sharded = PoolPolicy(key, "p", 1, cache=Cache())
    assert (sharded.status().cache, sharded.status().held) == (4, [2, 3])
    assert PoolPolicy(key, "p", 1, cache=Cache(), say_cache=False).status().cache is None  # --shard-affinity off
    flat = PoolPolicy(StreamKey.parse("splits:800:1"), "p", 1, cache=Cache())
    assert flat.status().cache is None



def test_the_lookahead_names_the_next_shard_of_the_epoch_once_per_shard_then_the_next_epochs_first():
    from stoker.producer.serve.sharding import EpochOrders, ShardLookahead

    key = StreamKey.parse("1/2:1000:3:64x1")  # dataset shards 1, 3, 5, ..., 15 (the last holds 40 records)
    ahead = ShardLookahead(EpochOrders(key))
    order = key.order(0)
    sequence = [int(s) for s in dict.fromkeys((order // 64).tolist())]
    named = [ahead.after(0, int(r)) for r in order]
    assert [n for n in named if n is not None] == sequence[1:] + [int(key.order(1)[0] // 64)]
    assert sum(n is not None for n in named) == len(sequence)  # once per shard reached, not per record
    assert not ShardLookahead(EpochOrders(StreamKey.parse("splits:1000:3:64x1"))).active  # a pool: trainers decide
    flat = ShardLookahead(EpochOrders(StreamKey.parse("0/2:1000:3")))
    assert flat.after(0, 5) is None  # no layout: nothing to fetch ahead
