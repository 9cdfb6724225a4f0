"""One open epoch of an elastic pool in epoch order 2, kept as ranges of positions: memory follows the work in flight.

The twin of ``split_epoch.SplitEpoch`` for a stream key in epoch order 2 (``protocol/epochs/epoch_order.py``), which is
computed lazily: nothing here holds an entry per record. The epoch's positions are cut into splits of ``split``
positions, afresh at each window of shards (a split lies in one window, so it touches only that window's shards);
this trainer's share is the splits of the *share blocks* ``b`` with ``b % world == rank``, a block being
``SplitCut.share_block`` consecutive splits (at most ``SHARE_BLOCKS`` blocks an epoch), so that a trainer's share, and
what it consumed of it, is a few thousand ranges of positions however many splits the epoch has (splits dealt one by
one, ``s % world``, made one range per split consumed). The scheduler speaks to an epoch in *keys*:
``locate(records)`` turns a batch's records into positions once, and every other method takes positions.

Kept, all as ``PositionRanges``: the positions that *arrived* (a batch brought them, or a restored checkpoint
consumed them) and those *done* (consumed, or failed); the splits handed out in the first pass (ranges of split
numbers: a prefix and a few ahead of it). Per window of shards, where its splits begin (``O(windows)``). ``left`` is
the number of this share's splits not all done: the epoch completes at 0. Splits handed out again (``returned``)
wait in a deque. So an epoch of 10^10 records costs the order's per-shard plan plus what is in flight.
Not thread-safe: the scheduler's caller holds the control plane's lock.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, Optional, Union

import numpy as np

from stoker.protocol.epochs.epoch_order import LazyOrder
from stoker.protocol.exact_messages import WorkItem
from stoker.protocol.input_state import StreamKey
from stoker.protocol.epochs.position_ranges import PositionRanges

from stoker.consumer.exact.pool.pool_member import ShardChoice
from stoker.consumer.exact.pool.split_epoch import SplitEpoch

_CHUNK = 65536  # splits handled at once where an epoch's every split is visited
#: An epoch's splits are dealt to its trainers in at most this many blocks of consecutive splits (see the module doc).
SHARE_BLOCKS = 4096
#: Splits a shard-preferring pick scans from the cursor, when most shards qualify (a pick is advice, never needed).
PICK_SCAN = 4096


def covered_splits(ranges: PositionRanges, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """bool per split ``[starts[i], ends[i])``: whether ``ranges`` holds every position of it (vectorised)."""
    if not len(starts) or not ranges.range_count:
        return np.zeros(len(starts), bool)
    at = np.searchsorted(ranges.ends, starts, side="right")
    inside = at < ranges.range_count
    at = np.minimum(at, ranges.range_count - 1)
    return inside & (ranges.starts[at] <= starts) & (ranges.ends[at] >= ends)


def make_split_epoch(key: StreamKey, epoch: int, consumed: Union[np.ndarray, PositionRanges], split: int,
                     rank: int = 0, world: int = 1) -> "PoolEpoch":
    """Open epoch ``epoch`` of pool ``key`` for share ``rank`` of ``world``: a ``SplitEpoch`` over a bitmap in epoch
    order 1, a ``RangeSplitEpoch`` over ranges in order 2. ``consumed``: the input state's (copied, not kept)."""
    if key.order_version == 2:
        assert isinstance(consumed, PositionRanges)
        return RangeSplitEpoch(key.lazy_order(), epoch, key.records, consumed, split, rank, world)
    assert isinstance(consumed, np.ndarray)
    return SplitEpoch(key.order(epoch), consumed.copy(), split, rank, world, key.block, key.window)


class SplitCut:
    """Where the splits of epoch ``epoch`` of a pool in epoch order 2 lie: every ``split`` positions, afresh at each
    window of shards. A function of its arguments only (trainers sharing a pool cut alike). ``O(windows)``."""

    def __init__(self, order: LazyOrder, epoch: int, records: int, split: int) -> None:
        self.split = split
        bounds = order.plan(epoch).bounds  # int64 [windows + 1], the order's own (read-only): views, not copies
        assert bounds[-1] == records, "the order's dataset is not the pool's"
        self.window_start, self.window_end = bounds[:-1], bounds[1:]
        per_window = -(-(self.window_end - self.window_start) // split)
        self.first_split = np.concatenate([[0], np.cumsum(per_window)]).astype(np.int64)  # int64 [windows + 1]
        self.split_count = int(self.first_split[-1])
        self.share_block = max(1, -(-self.split_count // SHARE_BLOCKS))  # consecutive splits dealt to one trainer

    def bounds_of(self, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 start and end positions of each of ``splits`` (vectorised)."""
        splits = np.asarray(splits, np.int64)
        window = np.searchsorted(self.first_split, splits, side="right") - 1
        starts = self.window_start[window] + (splits - self.first_split[window]) * self.split
        return starts, np.minimum(starts + self.split, self.window_end[window])

    def split_of(self, positions: np.ndarray) -> np.ndarray:
        """int64: the split each position falls in."""
        window = np.searchsorted(self.window_start, positions, side="right") - 1
        return self.first_split[window] + (positions - self.window_start[window]) // self.split

    def owners(self, splits: np.ndarray, world: int) -> np.ndarray:
        """int64: the rank of ``world`` whose share each of ``splits`` is in (its share block's, dealt in turn)."""
        return (np.asarray(splits, np.int64) // self.share_block) % world

    def next_of(self, split: int, rank: int, world: int) -> int:
        """The first split at or after ``split`` in share ``rank`` of ``world`` (``split_count`` if none)."""
        block = split // self.share_block
        if block % world == rank:
            return split
        return min(self.split_count, (block + (rank - block) % world) * self.share_block)

    def _blocks(self, rank: int, world: int) -> range:
        return range(rank, -(-self.split_count // self.share_block), world)

    def share_splits(self, rank: int, world: int) -> "Iterator[np.ndarray]":
        """The splits of share ``rank`` of ``world``, in chunks (an epoch may have millions)."""
        blocks, per = self._blocks(rank, world), max(1, _CHUNK // self.share_block)
        for at in range(0, len(blocks), per):
            first = np.asarray(blocks[at:at + per], np.int64) * self.share_block
            splits = (first[:, None] + np.arange(self.share_block, dtype=np.int64)[None, :]).ravel()
            yield splits[splits < self.split_count]

    def share(self, rank: int, world: int, limit: int) -> PositionRanges:
        """The positions of share ``rank`` of ``world`` as ranges over ``[0, limit)``: one a share block (its splits
        are consecutive, and so are their positions: windows lie end to end)."""
        first = np.asarray(self._blocks(rank, world), np.int64) * self.share_block
        if not len(first):
            return PositionRanges(limit)
        last = np.minimum(first + self.share_block, self.split_count) - 1
        return PositionRanges.from_ranges(self.bounds_of(first)[0], self.bounds_of(last)[1], limit)


class RangeSplitEpoch:
    """See the module doc. ``order``: the pool's lazy order; ``consumed``: what the input state says the steps took
    already (positions of epoch ``epoch``); ``split``: positions per split; ``rank`` of ``world``: this share."""

    LEFT_UNIT = "split"  #: what ``left`` counts: splits of the share not all done (records would need a count each)

    def __init__(self, order: LazyOrder, epoch: int, records: int, consumed: PositionRanges, split: int,
                 rank: int = 0, world: int = 1) -> None:
        self.order, self.epoch, self.records = order, epoch, records
        self.split, self.rank, self.world = split, rank, world
        self.cut = SplitCut(order, epoch, records, split)
        self.split_count = self.cut.split_count
        self.bounds_of, self.split_of = self.cut.bounds_of, self.cut.split_of
        self.arrived = consumed.copy()  # positions arrived (held or consumed), or failed
        self.done = consumed.copy()  # positions consumed or failed
        self.handed = PositionRanges(max(1, self.split_count))  # split numbers handed out in the first pass
        self.cursor = 0  # next split of the first pass
        self.returned: deque = deque()  # splits given back by producers that left or are stuck
        self.left = sum(int((~covered_splits(self.done, *self.bounds_of(splits))).sum())
                        for splits in self.cut.share_splits(rank, world))  # splits of the share not all done

    # ---- where splits lie ------------------------------------------------------------------

    def bounds(self, s: int) -> tuple[int, int]:
        starts, ends = self.bounds_of(np.array([s]))
        return int(starts[0]), int(ends[0])

    def locate(self, records: np.ndarray) -> np.ndarray:
        """The positions of ``records`` (indices in the dataset) in this epoch: the keys every other method takes."""
        return self.order.positions(self.epoch, np.asarray(records, np.int64))

    def shard_of_split(self, s: int) -> int:
        """The shard of split ``s``'s middle record (a split lies in one window: with windows of one shard, its)."""
        start, end = self.bounds(s)
        return int(self.order.shard_at(self.epoch, np.array([(start + end) // 2], np.int64))[0])

    # ---- what the scheduler asks -----------------------------------------------------------

    def mine(self, positions: np.ndarray) -> np.ndarray:
        """bool per position: whether it falls in a split of this trainer's share."""
        if self.world == 1:
            return np.ones(len(positions), bool)
        return self.cut.owners(self.split_of(positions), self.world) == self.rank

    def is_mine(self, s: int) -> bool:
        """Whether split ``s`` is in this trainer's share."""
        return self.world == 1 or (s // self.cut.share_block) % self.world == self.rank

    def unfinished(self, s: int) -> bool:
        """Whether split ``s`` still has positions to arrive."""
        return not self.arrived.covers(*self.bounds(s))

    def left_in(self, s: int) -> int:
        """Positions of split ``s`` not arrived."""
        start, end = self.bounds(s)
        return end - start - len(self.arrived.within(start, end))

    def skip_arrived(self) -> int:
        """Move the cursor past the splits that arrived whole (a restored checkpoint's consumed prefix: a million
        splits at 10^10 records) in one step, and return it: asking each in turn cost 60 us a split."""
        if self.cursor < self.split_count:
            first = self.arrived.first_missing(self.bounds(self.cursor)[0])
            self.cursor = self.split_count if first >= self.records else max(
                self.cursor, int(self.split_of(np.array([first], np.int64))[0]))
            self.cursor = self.cut.next_of(self.cursor, self.rank, self.world)  # past other trainers' blocks
        return self.cursor

    def mark_handed(self, s: int) -> None:
        """Split ``s`` is handed out in the first pass."""
        self.handed.add_range(s, s + 1)

    def item(self, e: int, s: int) -> WorkItem:
        """Split ``s`` (of this epoch, ``e``) as work to send: its positions, skipping those that arrived."""
        start, end = self.bounds(s)
        return WorkItem(e, start, end, (self.arrived.within(start, end) - start).tolist())

    def arrive(self, positions: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Positions of a batch (of the share) arrived: ``(first, splits)``, whether each row is the position's first
        arrival (twice in one batch counts once) and the splits with nothing left to arrive now."""
        first = ~self.arrived.contains(positions)
        _, unique_at = np.unique(positions, return_index=True)
        once = np.zeros(len(positions), bool)
        once[unique_at] = True
        first &= once
        fresh = positions[first]
        if not len(fresh):
            return first, []
        self.arrived.add(fresh)
        touched = np.unique(self.split_of(fresh))
        starts, ends = self.bounds_of(touched)
        return first, touched[covered_splits(self.arrived, starts, ends)].tolist()

    def finish(self, positions: np.ndarray) -> None:
        """These positions are done (consumed, or a producer could not make them)."""
        positions = np.asarray(positions, np.int64)
        new = np.unique(positions[~self.done.contains(positions)]) if len(positions) else positions
        if not len(new):
            return
        self.done.add(new)
        touched = np.unique(self.split_of(new))
        if self.world > 1:
            touched = touched[self.cut.owners(touched, self.world) == self.rank]
        starts, ends = self.bounds_of(touched)
        # Each split counts once: it holds a position that was not done before, so it was not covered before.
        self.left -= int(covered_splits(self.done, starts, ends).sum())

    def take_pending(self, shards: ShardChoice, free: Callable[[int], bool]) -> Optional[int]:
        """A split of this share not handed out yet whose shard is one of ``shards``, the one that comes first in the
        epoch; marked handed. None if none is found among at most ``PICK_SCAN`` splits (the scheduler then takes the
        next split: a pick by shard is advice, never needed for the epoch to complete). O(PICK_SCAN + shards named),
        never O(shards of the dataset)."""
        wanted = shards.numbers
        if not shards.exclude and not len(wanted):
            return None
        if not shards.exclude and len(wanted) <= PICK_SCAN:  # the windows of those shards, in the epoch's order
            spans = [(int(self.cut.first_split[w]), int(self.cut.first_split[w + 1]))
                     for w in np.unique(self.order.window_of_shards(self.epoch, wanted)).tolist()]
        else:  # most shards qualify: the next splits from the cursor are as good as any
            spans = [(self.cursor, self.split_count)]
        budget = PICK_SCAN
        for first, end in spans:
            # Splits before the cursor were handed out by it, are done, or are held: never pending.
            first = max(first, self.cursor)
            if first >= end:
                continue
            splits = np.arange(first, min(end, first + budget), dtype=np.int64)
            budget -= len(splits)
            splits = splits[(self.cut.owners(splits, self.world) == self.rank) & ~self.handed.contains(splits)]
            starts, ends = self.bounds_of(splits)
            shard = self.order.shard_at(self.epoch, (starts + ends) // 2)
            for s in splits[shards.holds(shard)].tolist():
                if self.unfinished(s):
                    self.mark_handed(s)
                    if free(s):
                        return s
            if budget <= 0:
                break
        return None


#: What the scheduler holds of an open epoch: either kind answers the same questions.
PoolEpoch = Union[SplitEpoch, RangeSplitEpoch]
