"""Resume on another number of trainers in epoch order 2: states kept as ranges of epoch positions merge into one
job state, and any rank of any world continues from it with each position left served to exactly one new rank.

As tests/exact/test_state_merge.py does for order 1, the shares are judged by the pool's own bookkeeping
(``SplitCut``, ``RangeSplitEpoch``: what a new rank's scheduler will ask for), not by a re-implementation."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.consumer import merge_states
from stoker.consumer.exact.pool.range_split_epoch import RangeSplitEpoch, SplitCut
from stoker.consumer.exact.pool.split_plan import split_records
from stoker.consumer.exact.state import SavedState, merge_saved, pack_state, parse_state, state_for_share
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.input_state import InputState, RangeProgress, StreamKey

RECORDS, SEED, BATCH = 20000, 5, 8
POOL = f"splits:{RECORDS}:{SEED}:700x2:o2"  # windows of two shards of 700: splits are cut afresh at each window
ORDER = StreamKey.parse(POOL).lazy_order()


def _share(e: int, rank: int, world: int) -> np.ndarray:
    """bool by position: share ``rank`` of ``world``'s positions of epoch ``e``."""
    return SplitCut(ORDER, e, RECORDS, split_records(RECORDS, BATCH, world)).share(rank, world, RECORDS).to_bitmap()


def _rank_state(rank: int, world: int, consumed: dict[int, np.ndarray]) -> SavedState:
    """Rank ``rank``'s saved state after consuming ``consumed`` (epoch -> bool by position) of its share, its
    complete epochs closed at the front as its scheduler closes them."""
    progress = RangeProgress(RECORDS)
    for e, bits in consumed.items():
        assert not (bits & ~_share(e, rank, world)).any(), "a rank consumes only its share"
        progress.open[e] = PositionRanges.from_bitmap(bits)
    while progress.completed in progress.open and (
            progress.open[progress.completed].to_bitmap() | ~_share(progress.completed, rank, world)).all():
        progress.advance(progress.completed + 1)
    return SavedState(f"t{rank}", InputState({POOL: progress}), (rank, world),
                      {POOL: split_records(RECORDS, BATCH, world)})


def _new_ranks_take(job: SavedState, world: int, epoch: int) -> list[np.ndarray]:
    """What each rank of a new job of ``world`` will ask for in ``epoch`` (bool by position): its share's positions
    not arrived in its scheduler's epoch."""
    wanted = []
    split = split_records(RECORDS, BATCH, world)
    for rank in range(world):
        state = state_for_share(parse_state(pack_state(job)), (rank, world)).state
        progress = state.streams.get(POOL, RangeProgress(RECORDS))
        epoch_state = RangeSplitEpoch(ORDER, epoch, RECORDS, progress.consumed(epoch), split, rank, world)
        mine = epoch_state.mine(np.arange(RECORDS, dtype=np.int64))
        wanted.append(mine & ~epoch_state.arrived.to_bitmap())
    return wanted


@settings(max_examples=25, deadline=None)
@given(old_world=st.integers(1, 4), new_world=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_every_position_the_old_ranks_left_is_asked_for_by_exactly_one_new_rank(old_world, new_world, seed):
    rng = np.random.default_rng(seed)
    truth = {e: np.zeros(RECORDS, bool) for e in range(3)}
    states = []
    for rank in range(old_world):
        consumed = {}
        for e in range(3):  # epoch 0 mostly done, 1 half, 2 begun: each rank consumes part of its share
            share = _share(e, rank, old_world)
            bits = share & (rng.random(RECORDS) < (0.97, 0.5, 0.05)[e])
            if rng.random() < 0.5 and e == 0:
                bits = share.copy()  # this rank completed epoch 0: its ranges are dropped, only its share counts
            consumed[e] = bits
            truth[e] |= bits
        states.append(_rank_state(rank, old_world, consumed))
    rng.shuffle(states)
    job = parse_state(merge_states([pack_state(s) for s in states]))
    progress = job.state.streams[POOL]
    assert isinstance(progress, RangeProgress)
    for e in range(3):
        np.testing.assert_array_equal(progress.consumed(e).to_bitmap(), truth[e])
        asked = np.sum(_new_ranks_take(job, new_world, e), axis=0)
        np.testing.assert_array_equal(asked, (~truth[e]).astype(int))  # once each, and only what is left


def test_a_pool_of_10_to_the_10_records_merges_mid_epoch_into_a_state_of_kilobytes():
    """Two ranks of a 10^10-record pool, each with a consumed prefix of its share and holes in flight: the merge and
    a new rank's take handle ranges, never a record each (a bitmap would be 10 GB)."""
    pool = "splits:10000000000:3:10000x1:o2"
    split = split_records(10**10, 256, 2)
    cut = SplitCut(StreamKey.parse(pool).lazy_order(), 0, 10**10, split)
    states = []
    for rank in range(2):
        splits = np.arange(rank, 2000, 2)  # its first thousand splits, then a few more with holes
        starts, ends = cut.bounds_of(splits)
        consumed = PositionRanges.from_ranges(starts, ends, 10**10)
        consumed.add(cut.bounds_of(np.array([2000 + rank]))[0] + np.arange(0, 100, 3))
        progress = RangeProgress(10**10, 0, {0: consumed})
        states.append(SavedState(f"t{rank}", InputState({pool: progress}), (rank, 2), {pool: split}))
    job_bytes = merge_states([pack_state(s) for s in states])
    assert len(job_bytes) < 4096
    job = merge_saved([parse_state(pack_state(s)) for s in states])
    merged = job.state.streams[pool].open[0]
    assert merged.count() == sum(s.state.streams[pool].open[0].count() for s in states)
    taken = state_for_share(parse_state(job_bytes), (1, 3)).state.streams[pool]
    assert taken.open[0] == merged


def test_stoker_state_info_describes_an_order_2_state_without_a_record_each(tmp_path):
    from conftest import stoker_cli

    pool = "splits:10000000000:3:10000x1:o2"
    consumed = PositionRanges.from_ranges(np.array([0, 10**6]), np.array([500_000, 2 * 10**6]), 10**10)
    saved = SavedState("t0", InputState({pool: RangeProgress(10**10, 2, {2: consumed})}), (0, 1), {pool: 4096})
    (tmp_path / "state").write_bytes(pack_state(saved))
    out = stoker_cli("state", "info", str(tmp_path / "state"))
    assert out.returncode == 0, out.stderr
    assert f"{pool}, split 4096: 2 epoch(s) complete; epoch 2: 1500000/10000000000" in out.stdout


def test_a_rank_of_two_keeps_its_share_in_a_few_thousand_ranges_and_restores_it():
    """Splits dealt one by one (s % world) made a rank's consumed positions one range per split: millions at 10^10
    records, a checkpoint refused on restore. Dealt in share blocks, a share is at most SHARE_BLOCKS / world ranges."""
    from stoker.consumer.exact.pool.range_split_epoch import SHARE_BLOCKS
    from stoker.protocol.input_state import InputState

    pool = "splits:10000000000:7:4096x1:o2"
    split = split_records(10**10, 64, 2)
    cut = SplitCut(StreamKey.parse(pool).lazy_order(), 0, 10**10, split)
    assert cut.split_count > 4 * 10**6
    share = cut.share(0, 2, 10**10)
    assert share.range_count <= SHARE_BLOCKS // 2 and share.count() > 4 * 10**9
    consumed = share.copy()
    consumed.add(cut.bounds_of(np.array([cut.next_of(0, 1, 2)]))[0] + np.arange(0, 50, 7))  # not ours: ignored here
    state = InputState({pool: RangeProgress(10**10, 0, {0: consumed})})
    back = InputState.from_bytes(state.to_bytes())
    assert back.streams[pool].open[0] == consumed
    epoch = RangeSplitEpoch(StreamKey.parse(pool).lazy_order(), 0, 10**10, consumed, split, 0, 2)
    assert epoch.left == 0  # every split of rank 0's share is done: the epoch completes for it
    other = RangeSplitEpoch(StreamKey.parse(pool).lazy_order(), 0, 10**10, consumed, split, 1, 2)
    assert other.left == sum(len(s) for s in cut.share_splits(1, 2)) and other.is_mine(cut.next_of(0, 1, 2))
