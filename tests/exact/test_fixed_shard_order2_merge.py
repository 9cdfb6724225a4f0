"""Merging the states of a job reading fixed shards in epoch order 2 (issue 41): as in order 1, an epoch a rank's
state completed is complete for every rank (a fixed shard's producer closes an epoch once every record of it is
consumed, by whichever trainer), and open epochs are the union of the ranks' ranges; nothing per record."""

from __future__ import annotations

import numpy as np

from stoker.consumer import merge_states
from stoker.consumer.exact.state import SavedState, pack_state, parse_state, state_for_share
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.input_state import InputState, RangeProgress, StreamKey

SHARD0, SHARD1 = "0/2:4000:3:100x2:o2", "1/2:4000:3:100x2:o2"
SIZE = StreamKey.parse(SHARD0).size  # 2000


def _ranges(*spans: tuple[int, int]) -> PositionRanges:
    ranges = PositionRanges(SIZE)
    for start, end in spans:
        ranges.add_range(start, end)
    return ranges


def test_fixed_shard_states_in_order_2_merge_completed_epochs_whole_and_open_ones_unioned():
    rank0 = SavedState("t0", InputState({SHARD0: RangeProgress(SIZE, 1, {1: _ranges((0, 300))})}), (0, 2))
    rank1 = SavedState("t1", InputState({SHARD0: RangeProgress(SIZE, 0, {0: _ranges((0, 50))}),
                                         SHARD1: RangeProgress(SIZE, 0, {0: _ranges((10, 20), (700, 900))})}), (1, 2))
    job = parse_state(merge_states([pack_state(rank0), pack_state(rank1)]))
    assert job.trainers == ["t0", "t1"]
    first, second = job.state.streams[SHARD0], job.state.streams[SHARD1]
    assert isinstance(first, RangeProgress) and isinstance(second, RangeProgress)
    assert first.completed == 1 and list(first.open) == [1] and first.open[1] == _ranges((0, 300))
    assert second.completed == 0 and second.open[0] == _ranges((10, 20), (700, 900))  # the one rank that read it
    for rank in range(2):  # each rank of the resumed job takes the whole job's progress of every fixed shard
        mine = state_for_share(parse_state(pack_state(job)), (rank, 2))
        assert mine.state.streams[SHARD0].open[1] == _ranges((0, 300)) and mine.trainer == f"t{rank}"


def test_every_position_consumed_by_some_rank_is_consumed_in_the_merge():
    rng = np.random.default_rng(5)
    bitmaps = [rng.random(SIZE) < 0.3 for _ in range(3)]
    states = [pack_state(SavedState(f"t{r}", InputState({SHARD1: RangeProgress(SIZE, 2, {
        2: PositionRanges.from_bitmap(bits)})}), (r, 3))) for r, bits in enumerate(bitmaps)]
    merged = parse_state(merge_states(states)).state.streams[SHARD1]
    assert merged.completed == 2
    assert np.array_equal(merged.open[2].to_bitmap(), bitmaps[0] | bitmaps[1] | bitmaps[2])
