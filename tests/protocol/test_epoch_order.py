"""Epoch order 2 (protocol/epochs/epoch_order.py): a bijection, invertible, lazy, windowed, pinned to its definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.protocol.epochs.epoch_order import (
    GOLDEN,
    SHARDS_TAG,
    LazyOrder,
    ShardTable,
    full_order,
    keyed_bijection,
    mix,
    round_keys,
)

M64 = 2**64 - 1


# A scalar reading of docs/protocol.md "Epoch order 2", one Python int at a time: what another implementation
# would write from the text. The vectorised module must agree with it on every record.
def ref_mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def ref_chain(h: int, v: int) -> int:
    return ref_mix(((h ^ v) + 0x9E3779B97F4A7C15) & M64)


def ref_keys(seed: int, epoch: int, tag: int) -> list[int]:
    h = ref_chain(ref_chain(ref_chain(0, seed % 2**64), epoch), tag)
    return [ref_chain(h, i) for i in range(8)]


def ref_bijection(x: int, n: int, keys: list[int]) -> int:
    b = 2
    while 2**b < n:
        b += 2
    half, mask = b // 2, (1 << b // 2) - 1
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (ref_mix(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


def ref_order(sizes: list[int], seed: int, epoch: int, window: int) -> list[int]:
    shards = len(sizes)
    offsets = [sum(sizes[:j]) for j in range(shards)]
    perm = [ref_bijection(r, shards, ref_keys(seed, epoch, 2**64 - 1)) for r in range(shards)]
    cum = [sum(sizes[s] for s in perm[:r]) for r in range(shards + 1)]
    per_window = shards if window == 0 else min(window, shards)
    order = []
    for w, first in enumerate(range(0, shards, per_window)):
        start, end, keys = cum[first], cum[min(first + per_window, shards)], ref_keys(seed, epoch, w)
        for p in range(start, end):
            c = start + ref_bijection(p - start, end - start, keys)
            rank = max(r for r in range(shards) if cum[r] <= c)
            order.append(offsets[perm[rank]] + c - cum[rank])
    return order


TABLES = [  # (sizes, window): unequal sizes, one shard, one record, W = 0, W > S, sizes far from powers of two
    ([3, 7, 1, 9, 4, 12, 5], 2),
    ([3, 7, 1, 9, 4, 12, 5], 0),
    ([3, 7, 1, 9, 4, 12, 5], 50),
    ([1], 1),
    ([1], 0),
    ([1000], 0),
    ([1] * 37, 4),
    ([17, 1, 1, 300, 2, 65, 129, 1, 33], 3),
    ([1025] * 5 + [3], 2),
]


@pytest.mark.parametrize("sizes, window", TABLES)
def test_each_epoch_is_a_permutation_and_positions_inverts_it(sizes, window):
    order = LazyOrder(ShardTable.from_sizes(sizes), seed=11, window=window)
    n = sum(sizes)
    for epoch in (0, 1, 2**31 - 1):
        records = full_order(order, epoch)
        assert np.array_equal(np.sort(records), np.arange(n))
        assert np.array_equal(order.positions(epoch, records), np.arange(n))
        assert np.array_equal(order.at(epoch, order.positions(epoch, np.arange(n))), np.arange(n))
        picks = np.random.default_rng(epoch).integers(0, n, 50)
        assert np.array_equal(order.at(epoch, picks), records[picks])
        assert np.array_equal(order.shard_at(epoch, picks), order.table.shard_of(records[picks]))


@pytest.mark.parametrize("sizes, window", TABLES[:3] + TABLES[7:8])
@pytest.mark.parametrize("seed", [0, 42, -1, 2**70 + 5])
def test_the_module_computes_what_the_documented_definition_says(sizes, window, seed):
    order = LazyOrder(ShardTable.from_sizes(sizes), seed=seed, window=window)
    assert full_order(order, 3).tolist() == ref_order(sizes, seed, 3, window)


def test_the_mixer_is_splitmix64_and_the_key_chain_is_as_documented():
    # splitmix64 seeded 0 first returns mix(GOLDEN) = 0xE220A8397B1DCDAF (the published reference output)
    assert int(mix(np.uint64(GOLDEN))[0]) == 0xE220A8397B1DCDAF == ref_mix(GOLDEN)
    assert [int(k) for k in round_keys(-3, 9, SHARDS_TAG)[:, 0]] == ref_keys(-3, 9, SHARDS_TAG)
    assert [int(k) for k in round_keys(5, 1, 77)[:, 0]] == ref_keys(5, 1, 77)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 1000, 4097, 65537])
def test_keyed_bijection_permutes_its_domain_and_its_inverse_undoes_it(n):
    keys = round_keys(8, 2, 3)[:, 0]
    forward = keyed_bijection(np.arange(n), n, keys)
    assert np.array_equal(np.sort(forward), np.arange(n))
    assert np.array_equal(keyed_bijection(forward, n, keys, inverse=True), np.arange(n))


def test_small_domains_reach_every_permutation_with_uniform_marginals():
    # 1-bit Feistel halves with cycle walking: still every one of the 120 orders of 5, each record ~1/5 first
    seen, first = set(), np.zeros(5, int)
    for seed in range(3000):
        perm = tuple(keyed_bijection(np.arange(5), 5, round_keys(seed, 0, 0)[:, 0]).tolist())
        seen.add(perm)
        first[perm[0]] += 1
    assert len(seen) == 120
    assert first.min() > 500 and first.max() < 700  # 600 each expected, sd ~22


def test_same_arguments_give_the_same_order_and_others_a_different_one():
    table = ShardTable.from_sizes([40, 3, 90, 17, 5, 61])
    base = full_order(LazyOrder(table, 5, 2), 1)
    assert np.array_equal(full_order(LazyOrder(table, 5, 2), 1), base)
    assert np.array_equal(full_order(LazyOrder(table, 5 + 2**64, 2), 1), base)  # the seed is taken mod 2**64
    assert not np.array_equal(full_order(LazyOrder(table, 5, 2), 2), base)
    assert not np.array_equal(full_order(LazyOrder(table, 6, 2), 1), base)
    assert not np.array_equal(full_order(LazyOrder(table, 5, 3), 1), base)


@pytest.mark.parametrize("sizes, window", TABLES)
def test_a_window_s_positions_hold_exactly_the_records_of_its_shards(sizes, window):
    table = ShardTable.from_sizes(sizes)
    order = LazyOrder(table, seed=3, window=window)
    plan, starts = order.plan(4), order.window_starts(4)
    per_window = table.shards if window == 0 else min(window, table.shards)
    assert starts[0] == 0 and np.all(np.diff(starts) > 0)
    bounds = np.append(starts, table.records)
    for w in range(starts.size):
        shards = plan.perm[w * per_window:(w + 1) * per_window]
        expected = np.concatenate([np.arange(table.offsets[s], table.offsets[s] + table.sizes[s]) for s in shards])
        got = order.records(4, int(bounds[w]), int(bounds[w + 1]))
        assert np.array_equal(np.sort(got), np.sort(expected))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(-2**70, 2**70),
       st.integers(0, 2**31 - 1), st.integers(0, 15))
def test_fuzz_random_tables_are_permuted_inverted_and_windowed(sizes, seed, epoch, window):
    table = ShardTable.from_sizes(sizes)
    order = LazyOrder(table, seed, window)
    records = full_order(order, epoch)
    assert np.array_equal(np.sort(records), np.arange(table.records))
    assert np.array_equal(order.positions(epoch, records), np.arange(table.records))
    shard_of = table.shard_of(records)
    window_of_position = np.searchsorted(order.window_starts(epoch), np.arange(table.records), side="right") - 1
    for w in np.unique(window_of_position):  # each shard's records sit in one window
        assert not set(shard_of[window_of_position == w]) & set(shard_of[window_of_position != w])


def test_pinned_vectors_fail_if_the_definition_changes():
    table = ShardTable.from_sizes([3, 7, 1, 9, 4, 12, 5])
    assert table.digest() == "c460517a13d0b976"
    order = LazyOrder(table, seed=42, window=2)
    assert order.plan(0).perm.tolist() == [4, 5, 3, 0, 6, 1, 2]
    assert order.window_starts(0).tolist() == [0, 16, 28, 40]
    assert order.records(0, 0, 16).tolist() == [34, 28, 24, 27, 31, 20, 22, 29, 33, 30, 21, 23, 25, 35, 32, 26]
    assert order.records(1, 0, 8).tolist() == [6, 3, 5, 9, 8, 7, 10, 4]
    assert LazyOrder(table, seed=-1, window=0).records(5, 0, 8).tolist() == [14, 26, 39, 0, 20, 19, 2, 32]
    big = LazyOrder(ShardTable.uniform(10**10, 10**4), seed=2024, window=64)
    assert big.table.digest() == "098962aa5e6ba0c6"
    assert big.records(3, 7 * 10**9, 7 * 10**9 + 4).tolist() == [6522412719, 411167924, 3894156169, 6971184321]


def test_ten_billion_records_in_a_million_shards_are_served_lazily():
    table = ShardTable.uniform(10**10, 10**4)  # materialising the order would take 80 GB: this cannot run
    assert table.shards == 10**6
    order = LazyOrder(table, seed=9, window=16)
    start = int(order.window_starts(1)[1234])  # a split at the start of window 1234: inside it
    records = order.records(1, start, start + 1000)
    assert np.unique(records).size == 1000 and records.min() >= 0 and records.max() < 10**10
    assert np.array_equal(order.positions(1, records), np.arange(start, start + 1000))
    assert np.array_equal(order.at(1, np.arange(start, start + 1000)[::-1]), records[::-1])
    shards = order.shard_at(1, np.arange(start, start + 1000))
    assert np.array_equal(shards, table.shard_of(records))
    assert set(shards) <= set(order.plan(1).perm[1234 * 16:1235 * 16].tolist())  # only the window's 16 shards
    ends = order.records(1, 10**10 - 3, 10**10)
    assert np.array_equal(order.positions(1, ends), np.arange(10**10 - 3, 10**10))


def test_a_window_of_equal_shards_is_well_mixed():
    table = ShardTable.uniform(8000, 1000)
    records = full_order(LazyOrder(table, seed=1, window=8), 0)
    assert not np.all(np.diff(records[:1000]) > 0)
    rising = np.mean(np.diff(records) > 0)
    assert 0.45 < rising < 0.55  # 0.5 for a uniform shuffle, sd 0.006
    same_shard = np.mean(np.diff(table.shard_of(records)) == 0)
    assert 0.10 < same_shard < 0.15  # (1000 - 1) / (8000 - 1) = 0.125 for a uniform shuffle, sd 0.004


def test_plans_are_cached_for_the_last_few_epochs_only():
    order = LazyOrder(ShardTable.from_sizes([5, 6, 7]), seed=1, window=1, cached_epochs=3)
    first = order.plan(0)
    assert order.plan(0) is first
    for epoch in (1, 2, 3):
        order.plan(epoch)
    rebuilt = order.plan(0)
    assert rebuilt is not first and np.array_equal(rebuilt.perm, first.perm)
    assert first.nbytes == 3 * 4 * 2 + 4 * 8 + 4 * 8  # perm, rank_of int32; cum, bounds int64


@pytest.mark.parametrize("sizes, problem", [
    ([], "1 to"), ([[1, 2]], "1 to"), ([3, 0, 2], "each shard holds"), ([-1], "each shard holds"),
    ([2**32], "each shard holds"), ([1.5, 2], "integers"), ([2**32 - 1] * 300, "2\\*\\*40"),
])
def test_a_bad_shard_table_is_refused_naming_the_problem(sizes, problem):
    with pytest.raises(ValueError, match=problem):
        ShardTable.from_sizes(sizes)


def test_uniform_tables_and_their_limits():
    table = ShardTable.uniform(10, 4)
    assert table.sizes.tolist() == [4, 4, 2] and table.offsets.tolist() == [0, 4, 8] and table.records == 10
    assert table == ShardTable.from_sizes([4, 4, 2]) and table.digest() != ShardTable.uniform(10, 5).digest()
    assert table.shard_of(np.array([0, 3, 4, 9])).tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="at most 16777216"):
        ShardTable.uniform(10**10, 100)
    with pytest.raises(ValueError, match="records"):
        ShardTable.uniform(2**40 + 1, 2**31)
    with pytest.raises(ValueError):
        table.sizes[0] = 7  # read-only: a table never changes under an order


def test_out_of_range_arguments_are_refused():
    order = LazyOrder(ShardTable.from_sizes([4, 4, 2]), seed=1, window=1)
    for bad in (lambda: order.at(0, np.array([10])), lambda: order.at(0, np.array([-1])),
                lambda: order.positions(0, np.array([0, 10])), lambda: order.at(0, np.array([0.5])),
                lambda: order.records(0, 5, 4), lambda: order.records(0, 0, 11), lambda: order.at(-1, [0]),
                lambda: order.at(2**31, [0]), lambda: order.table.shard_of([10]),
                lambda: LazyOrder(order.table, 1, -1), lambda: full_order(LazyOrder(ShardTable.uniform(2**28, 2**20),
                                                                                     1, 1), 0)):
        with pytest.raises(ValueError):
            bad()
    assert order.records(0, 3, 3).size == 0 and order.positions(0, np.array([], np.int64)).size == 0
    assert order.at(0, np.array([0], np.uint64)).tolist() == order.records(0, 0, 1).tolist()
    with pytest.raises(ValueError, match="positions must lie in"):
        order.at(0, np.array([2**63 + 1], np.uint64))  # refused before a cast to int64 could wrap it negative


def test_keyed_bijection_refuses_a_value_outside_its_domain_instead_of_walking_for_ever():
    with pytest.raises(ValueError, match="below their domain size"):
        keyed_bijection(np.array([3, 5]), 5, round_keys(1, 0, 0)[:, 0])


def test_positions_of_recent_batches_are_kept_read_only_and_bounded():
    from stoker.protocol.epochs.epoch_order import MEMO_BATCHES

    order = LazyOrder(ShardTable.uniform(10**6, 1000), 3, 2)
    batch = order.records(0, 500, 756)
    first = order.positions(0, batch)
    assert order.positions(0, batch) is first and not first.flags.writeable  # asked again: the same answer
    assert np.array_equal(first, np.arange(500, 756))
    assert order.positions(1, batch) is not first  # another epoch is another question
    for start in range(0, 256 * (MEMO_BATCHES + 8), 256):
        order.positions(0, order.records(0, start, start + 256))
    assert len(order._memo) == MEMO_BATCHES
