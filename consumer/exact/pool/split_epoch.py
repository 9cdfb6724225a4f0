"""One open epoch of an elastic pool as this trainer's ``SplitScheduler`` sees it.

The epoch's order of the whole dataset (``epoch_order``) is cut into splits of ``split`` positions (afresh at
each window of shards of a two-level order, ``split_starts``); this
trainer's share is the splits ``s`` with ``s % world == rank``. Per record: whether it *arrived* (a batch
brought it, or it is not this trainer's, or a restored checkpoint consumed it) and whether it is *done*
(consumed, failed, or not this trainer's); per split: how many of its records of the share are still to
arrive. Vectorised over the batch's rows, so a batch costs the same at a thousand records as at a million.
Not thread-safe: the scheduler's caller holds the control plane's lock.

``EpochLog`` says which epochs completed without a line per epoch (a small dataset completes one a second).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from stoker.protocol.exact_messages import WorkItem

from stoker.consumer.exact.pool.pool_member import ShardChoice

log = logging.getLogger("stoker.consumer")

#: At most one INFO line per this many seconds for the epochs completed since the last one.
SUMMARY_EVERY_S = 60.0
_SHARE_DONE = "every record of this trainer's share consumed once"


def split_starts(order: np.ndarray, split: int, block: int = 0, window: int = 1) -> np.ndarray:
    """int64 [splits]: the position each split of an epoch begins at. Every ``split`` positions; in a two-level
    order (``block`` > 0, ``epoch_order``) also afresh at each window of ``window`` shards, so that a split never
    spans two windows (with one shard a window: a split is one shard's records, what a producer's cache holds).
    A function of its arguments only: trainers sharing a pool cut alike."""
    records = len(order)
    if not block or not records:
        return np.arange(0, records, split, dtype=np.int64)
    blocks = -(-records // block)
    first = np.full(blocks, records, np.int64)  # where each shard first appears: windows appear one after another
    shards, at = np.unique(order // block, return_index=True)
    first[shards] = at
    in_order = np.argsort(first, kind="stable")
    sizes = np.minimum(block, records - in_order * block)
    windows = np.add.reduceat(sizes, np.arange(0, blocks, max(1, window)))
    ends = np.cumsum(windows)
    return np.concatenate([np.arange(end - size, end, split, dtype=np.int64) for end, size in zip(ends, windows)])


def split_of_positions(starts: np.ndarray, records: int) -> np.ndarray:
    """int32 [records]: the split each position of an epoch falls in (``starts``: ``split_starts``)."""
    return np.repeat(np.arange(len(starts), dtype=np.int32), np.diff(np.append(starts, records)))


def share_mask(order: np.ndarray, split: int, rank: int, world: int, block: int = 0, window: int = 1) -> np.ndarray:
    """bool [records] by record: whether its split (in the epoch's ``order``, cut by ``split_starts``) is share
    ``rank`` of ``world``'s (splits ``s`` with ``s % world == rank``)."""
    if world == 1:
        return np.ones(len(order), bool)
    return _by_record(order, split_of_positions(split_starts(order, split, block, window), len(order)), rank, world)


def _by_record(order: np.ndarray, split_of: np.ndarray, rank: int, world: int) -> np.ndarray:
    """bool [records]: whether each record's split (``split_of``, by position) is share ``rank`` of ``world``'s."""
    mine = np.zeros(len(order), bool)
    mine[order] = split_of % world == rank
    return mine


class SplitEpoch:
    """See the module doc. ``order``: the epoch's records in order; ``consumed``: bool [records], what the input
    state says the steps took already (a restored checkpoint); ``block``, ``window``: the order's shard layout
    (``split_starts``)."""

    LEFT_UNIT = "record"  #: what ``left`` counts

    __slots__ = ("order", "position", "arrived", "done", "left", "split_left", "cursor", "returned", "split",
                 "rank", "world", "starts", "split_of", "split_shard", "handed", "pending", "by_shard", "shard_rank")

    def __init__(self, order: np.ndarray, consumed: np.ndarray, split: int, rank: int = 0, world: int = 1,
                 block: int = 0, window: int = 1) -> None:
        records = len(order)
        self.split, self.rank, self.world = split, rank, world
        self.order = order  # int64 [records]: record at each position
        self.position = np.empty(records, np.int32)  # position of each record
        self.position[order] = np.arange(records, dtype=np.int32)
        self.starts = split_starts(order, split, block, window)  # int64 [splits]: where each begins
        self.split_of = split_of_positions(self.starts, records)  # int32 [records]: split of each position
        mine = _by_record(order, self.split_of, rank, world)
        self.arrived = consumed | ~mine  # bool [records]: arrived (held or consumed), failed, or not ours
        self.done = consumed | ~mine  # bool [records]: consumed, failed, or not ours
        self.left = int((~self.done).sum())  # records of the share not done
        pending = ~consumed[order] & mine[order]  # by position
        # int32 [splits]: records of each split of the share not arrived (0 for other shares' splits)
        self.split_left = np.bincount(self.split_of, weights=pending, minlength=len(self.starts)).astype(np.int32)
        self.cursor = 0  # next split of the first pass
        self.returned: deque = deque()  # splits given back by producers that left or are stuck
        self._index_shards(block)

    def _index_shards(self, block: int) -> None:
        """The splits of each shard (of ``block`` records; 0: no layout), for ``ShardHoldings``: a split's shard is
        its middle record's (a split lies in one window of shards: with windows of one shard, in that shard)."""
        splits = len(self.split_left)
        self.handed = np.zeros(splits, bool)  # handed out in the first pass (by the cursor or by shard)
        if not block:
            self.split_shard = np.zeros(splits, np.int64)
            self.pending, self.by_shard, self.shard_rank = np.zeros(1, np.int32), {}, np.zeros(1, np.int64)
            return
        records, shards = len(self.order), -(-len(self.order) // block)
        middles = (self.starts + np.append(self.starts[1:], records)) // 2
        self.split_shard = self.order[middles] // block
        mine = np.flatnonzero(np.arange(splits) % self.world == self.rank)
        self.pending = np.bincount(self.split_shard[mine], minlength=shards).astype(np.int32)
        self.by_shard: dict[int, deque] = {}
        for s in mine.tolist():
            self.by_shard.setdefault(int(self.split_shard[s]), deque()).append(s)
        self.shard_rank = self.position[np.arange(shards, dtype=np.int64) * block]  # where each shard begins, about

    @property
    def split_count(self) -> int:
        return len(self.starts)

    def is_mine(self, s: int) -> bool:
        """Whether split ``s`` is in this trainer's share (``s % world == rank``)."""
        return s % self.world == self.rank

    def skip_arrived(self) -> int:
        """The cursor (here each split is asked in turn: a lookup each)."""
        return self.cursor

    def locate(self, records: np.ndarray) -> np.ndarray:
        """The keys the other methods take: in epoch order 1, the records themselves."""
        return records

    def shard_of_split(self, s: int) -> int:
        """The shard of split ``s`` (0 without a layout)."""
        return int(self.split_shard[s])

    def left_in(self, s: int) -> int:
        """Records of split ``s`` of the share not arrived."""
        return int(self.split_left[s])

    def mark_handed(self, s: int) -> None:
        """Split ``s`` is handed out in the first pass (by the cursor): not pending for its shard any more."""
        if not self.handed[s]:
            self.handed[s] = True
            if self.by_shard:
                self.pending[self.split_shard[s]] -= 1

    def take_pending(self, shards: ShardChoice, free: Callable[[int], bool]) -> Optional[int]:
        """A split not handed out yet of one of ``shards``, the shard that comes first in the epoch's order; marked
        handed. None if there is none (or the epoch has no shard layout). O(shards of the layout): order 1's epochs
        are O(records) already."""
        if not self.by_shard:
            return None
        shards = shards.mask(len(self.pending))
        while True:
            candidates = np.flatnonzero(shards & (self.pending > 0))
            if not candidates.size:
                return None
            shard = int(candidates[np.argmin(self.shard_rank[candidates])])
            queue = self.by_shard[shard]
            while queue:
                s = queue.popleft()
                if not self.handed[s]:
                    self.mark_handed(s)
                    if free(s):
                        return s
            self.pending[shard] = 0

    def mine(self, records: np.ndarray) -> np.ndarray:
        """bool per record: whether it falls in a split of this trainer's share."""
        if self.world == 1:
            return np.ones(len(records), bool)
        return self.split_of[self.position[records]] % self.world == self.rank

    def unfinished(self, s: int) -> bool:
        """Whether split ``s`` still has records of the share to arrive."""
        return self.split_left[s] > 0

    def item(self, e: int, s: int) -> WorkItem:
        """Split ``s`` (of this epoch, ``e``) as work to send: its positions, skipping the records that arrived."""
        start = int(self.starts[s])
        end = int(self.starts[s + 1]) if s + 1 < len(self.starts) else len(self.order)
        have = self.arrived[self.order[start:end]]
        return WorkItem(e, start, end, np.flatnonzero(have).tolist())

    def arrive(self, records: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Records of a batch (of the share, in the dataset) arrived: ``(first, splits)``, whether each row is the
        record's first arrival (a record twice in one batch counts once), and the splits that have nothing left to
        arrive now. Marks them arrived."""
        first = ~self.arrived[records]
        _, unique_at = np.unique(records, return_index=True)
        once = np.zeros(len(records), bool)
        once[unique_at] = True
        first &= once
        fresh = records[first]
        self.arrived[fresh] = True
        touched = self.split_of[self.position[fresh]]
        np.subtract.at(self.split_left, touched, 1)
        return first, np.unique(touched[self.split_left[touched] == 0]).tolist()

    def finish(self, records: np.ndarray) -> None:
        """These records are done (consumed, or a producer could not make them)."""
        new = records[~self.done[records]]
        self.done[new] = True
        self.left -= len(new)


class EpochLog:
    """The log of completed epochs, summarised: each epoch at DEBUG; at INFO the first, then at most one line per
    ``every`` seconds (default ``SUMMARY_EVERY_S``) for those completed since ("epochs 3-57 complete"), said with
    the next completion once the interval passed, with a finite run's last epoch, or by ``flush()``. Epochs
    complete in order, so what is pending is one range. Clock-injected (``now``) for tests."""

    def __init__(self, every: Optional[float] = None) -> None:
        self.every = SUMMARY_EVERY_S if every is None else every
        self.pending: Optional[tuple[int, int]] = None  # (first, last) completed, not yet said at INFO
        self._said_at: Optional[float] = None  # the last INFO line (None: none yet)

    def completed(self, epoch: int, last: bool = False, now: Optional[float] = None) -> None:
        """Epoch ``epoch`` completed (``last``: the run's last epoch)."""
        now = time.monotonic() if now is None else now
        log.debug("epoch %d complete: %s", epoch, _SHARE_DONE)
        self.pending = (self.pending[0] if self.pending is not None else epoch, epoch)
        if last or self._said_at is None or now - self._said_at >= self.every:
            self.flush(now)

    def flush(self, now: Optional[float] = None) -> None:
        """Say the epochs completed since the last INFO line, if any (the input closes)."""
        if self.pending is None:
            return
        first, last = self.pending
        if first == last:
            log.info("epoch %d complete: %s", first, _SHARE_DONE)
        else:
            log.info("epochs %d-%d complete: %s in each", first, last, _SHARE_DONE)
        self.pending, self._said_at = None, time.monotonic() if now is None else now
