"""One open epoch of an elastic pool as this trainer's ``SplitScheduler`` sees it.

The epoch's order of the whole dataset (``epoch_order``) is cut into splits of ``split`` positions; this
trainer's share is the splits ``s`` with ``s % world == rank``. Per record: whether it *arrived* (a batch
brought it, or it is not this trainer's, or a restored checkpoint consumed it) and whether it is *done*
(consumed, failed, or not this trainer's); per split: how many of its records of the share are still to
arrive. Vectorised over the batch's rows, so a batch costs the same at a thousand records as at a million.
Not thread-safe: the scheduler's caller holds the transport's lock.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from stoker.protocol.exact_messages import WorkItem


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
        """bool [records] by record: whether its split (in this epoch's order) is this trainer's."""
        records = len(self.order)
        if self.world == 1:
            return np.ones(records, bool)
        mine = np.zeros(records, bool)
        mine[self.order] = (np.arange(records) // self.split) % self.world == self.rank
        return mine

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
