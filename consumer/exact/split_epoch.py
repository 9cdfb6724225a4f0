"""One open epoch of an elastic pool as this trainer's ``SplitScheduler`` sees it.

The epoch's order of the whole dataset (``epoch_order``) is cut into splits of ``split`` positions; this
trainer's share is the splits ``s`` with ``s % world == rank``. Per record: whether it *arrived* (a batch
brought it, or it is not this trainer's, or a restored checkpoint consumed it) and whether it is *done*
(consumed, failed, or not this trainer's); per split: how many of its records of the share are still to
arrive. Vectorised over the batch's rows, so a batch costs the same at a thousand records as at a million.
Not thread-safe: the scheduler's caller holds the transport's lock.

``EpochLog`` says which epochs completed without a line per epoch (a small dataset completes one a second).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import numpy as np

from stoker.protocol.exact_messages import WorkItem

log = logging.getLogger("stoker.consumer")

#: At most one INFO line per this many seconds for the epochs completed since the last one.
SUMMARY_EVERY_S = 60.0
_SHARE_DONE = "every record of this trainer's share consumed once"


def share_mask(order: np.ndarray, split: int, rank: int, world: int) -> np.ndarray:
    """bool [records] by record: whether its split (in the epoch's ``order``, cut every ``split`` positions) is
    share ``rank`` of ``world``'s (splits ``s`` with ``s % world == rank``)."""
    records = len(order)
    if world == 1:
        return np.ones(records, bool)
    mine = np.zeros(records, bool)
    mine[order] = (np.arange(records) // split) % world == rank
    return mine


class SplitEpoch:
    """See the module doc. ``order``: the epoch's records in order; ``consumed``: bool [records], what the input
    state says the steps took already (a restored checkpoint)."""

    __slots__ = ("order", "position", "arrived", "done", "left", "split_left", "cursor", "returned", "split",
                 "rank", "world")

    def __init__(self, order: np.ndarray, consumed: np.ndarray, split: int, rank: int = 0, world: int = 1) -> None:
        records = len(order)
        self.split, self.rank, self.world = split, rank, world
        self.order = order  # int64 [records]: record at each position
        self.position = np.empty(records, np.int32)  # position of each record
        self.position[order] = np.arange(records, dtype=np.int32)
        mine = self._share_mask()
        self.arrived = consumed | ~mine  # bool [records]: arrived (held or consumed), failed, or not ours
        self.done = consumed | ~mine  # bool [records]: consumed, failed, or not ours
        self.left = int((~self.done).sum())  # records of the share not done
        pending = ~consumed[order] & mine[order]  # by position
        # int32 [splits]: records of each split of the share not arrived (0 for other shares' splits)
        self.split_left = np.bincount(np.arange(records) // split, weights=pending,
                                      minlength=-(-records // split)).astype(np.int32)
        self.cursor = 0  # next split of the first pass
        self.returned: deque = deque()  # splits given back by producers that left or are stuck

    def _share_mask(self) -> np.ndarray:
        return share_mask(self.order, self.split, self.rank, self.world)

    def mine(self, records: np.ndarray) -> np.ndarray:
        """bool per record: whether it falls in a split of this trainer's share."""
        if self.world == 1:
            return np.ones(len(records), bool)
        return (self.position[records] // self.split) % self.world == self.rank

    def unfinished(self, s: int) -> bool:
        """Whether split ``s`` still has records of the share to arrive."""
        return self.split_left[s] > 0

    def item(self, e: int, s: int) -> WorkItem:
        """Split ``s`` (of this epoch, ``e``) as work to send: its positions, skipping the records that arrived."""
        start, end = s * self.split, min(len(self.order), (s + 1) * self.split)
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
        touched = self.position[fresh] // self.split
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
