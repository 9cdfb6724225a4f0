"""An elastic pool's work, decided by the trainer: which producer serves which split of which epoch.

With ``--shard auto`` no producer owns a shard; the trainer owns the input state already
(exact mode), so it also hands out the work. Each epoch's order of the whole dataset
(``epoch_order(range(records), seed, epoch)``) is cut into *splits* of ``split`` positions;
this trainer's share is the splits ``s`` with ``s % world == rank`` (several data-parallel
trainers take disjoint shares, so nothing has to be agreed between them).

- ``top_up(i)`` hands producer ``i`` more splits until it has ``ahead`` unfinished ones: splits
  released by a producer that left first, then the oldest open epoch's next split. At most
  ``EPOCHS_AHEAD`` epoch beyond the oldest incomplete one is open, as with fixed shards.
- ``arrived(i, ...)`` is asked for every batch: a row is kept only if its record belongs to an
  open epoch, to this trainer's share, and has not arrived before (nor been consumed: a restored
  checkpoint). A split handed out twice (to a producer taken for dead that was not) therefore
  costs work, never a duplicate. Masked rows that carry an index are records the producer could
  not make (bad data): done, counted, never asked for again.
- ``release(i)``: producer ``i`` left the pool, disconnected or restarted: its unfinished splits
  go back, less what arrived, to be handed to the others.
- ``consumed(...)`` follows the steps; an epoch whose share is all consumed (or failed) is
  completed in the input state (its bitmap dropped); ``finished`` after ``epochs`` epochs.

Exactness follows from the trainer alone: a record is delivered to a step at most once per
epoch (``arrived``), and every record of the share is asked for until it arrived (``release``).
Not thread-safe: the transport calls it under its lock.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from stoker.protocol.exact_messages import MAX_SPLIT, WorkItem
from stoker.protocol.input_state import StreamKey, StreamProgress, epoch_order

log = logging.getLogger("stoker.consumer")

EPOCHS_AHEAD = 1
DEFAULT_AHEAD = 2  # unfinished splits each producer holds: one being served, one to go on with


@dataclass
class _Epoch:
    order: np.ndarray  # int64 [records]: record at each position
    position: np.ndarray  # int32 [records]: position of each record
    arrived: np.ndarray  # bool [records]: arrived (held or consumed) or failed
    done: np.ndarray  # bool [records]: consumed or failed
    left: int  # records of the share not done
    split_left: np.ndarray  # int32 [splits]: records of each split of the share not arrived (0 for others')
    cursor: int = 0  # next split of the first pass
    returned: deque = field(default_factory=deque)  # splits given back by producers that left


class SplitScheduler:
    """See the module doc. ``progress``: the trainer's state of this stream (marked by the steps)."""

    def __init__(self, key: StreamKey, progress: StreamProgress, epochs: Optional[int], split: int,
                 rank: int = 0, world: int = 1, ahead: int = DEFAULT_AHEAD) -> None:
        if not key.splits:
            raise ValueError(f"stream {key} is not an elastic pool's")
        if not 1 <= split <= MAX_SPLIT or not 0 <= rank < world:
            raise ValueError(f"split of {split} records (1-{MAX_SPLIT}) or share {rank}/{world} is invalid")
        self.key, self.progress, self.epochs, self.split = key, progress, epochs, split
        self.rank, self.world, self.ahead = rank, world, ahead
        self.records = key.records
        self.splits = -(-self.records // split)
        if rank >= self.splits:
            raise ValueError(f"share {rank}/{world} of an elastic pool is empty: {self.records} records make only "
                             f"{self.splits} split(s) of {split}; run fewer trainers or smaller batches")
        self.open: dict[int, _Epoch] = {}
        self.assigned: dict[int, dict[tuple[int, int], None]] = {}  # producer -> its unfinished splits, in order
        self.owner: dict[tuple[int, int], int] = {}
        self.duplicates = 0  # rows dropped: their record had arrived already
        self.foreign = 0  # rows dropped: not this trainer's (another share, an epoch not open)
        self.failed = 0  # records producers could not make
        self.handed_out = 0  # splits handed out, again after a release included
        self.released = 0  # splits taken back from producers that left
        self._open_epochs()

    # ---- epochs ----------------------------------------------------------------------------

    def _mine(self, split: int) -> bool:
        return split % self.world == self.rank

    def _share_mask(self, order: np.ndarray) -> np.ndarray:
        """bool [records] by record: whether its split (in this epoch's order) is this trainer's."""
        if self.world == 1:
            return np.ones(self.records, bool)
        mine = np.zeros(self.records, bool)
        positions = np.arange(self.records)
        mine[order] = (positions // self.split) % self.world == self.rank
        return mine

    def _open(self, e: int) -> None:
        order = epoch_order(np.arange(self.records, dtype=np.int64), self.key.seed, e)
        position = np.empty(self.records, np.int32)
        position[order] = np.arange(self.records, dtype=np.int32)
        consumed = self.progress.consumed(e).copy()
        mine = self._share_mask(order)
        done = consumed | ~mine
        pending = ~consumed[order] & mine[order]  # by position
        split_left = np.bincount(np.arange(self.records) // self.split, weights=pending,
                                 minlength=self.splits).astype(np.int32)
        self.open[e] = _Epoch(order, position, consumed | ~mine, done, int((~done).sum()), split_left)

    def _open_epochs(self) -> None:
        """Open the epochs the window allows; an epoch with nothing of this trainer's share in it (a small
        dataset, several trainers) completes at once, and the window moves on."""
        while True:
            self._close_done()
            last = self.progress.completed + EPOCHS_AHEAD
            opened = False
            for e in range(self.progress.completed, last + 1):
                if e not in self.open and (self.epochs is None or e < self.epochs):
                    self._open(e)
                    opened = True
            if not opened or not any(self.open[e].left == 0 for e in self.open):
                return

    def _close_done(self) -> None:
        while self.progress.completed in self.open and self.open[self.progress.completed].left == 0:
            e = self.progress.completed
            del self.open[e]
            self.progress.advance(e + 1)
            log.info("epoch %d complete: every record of this trainer's share consumed once", e)
        for e in [e for e in self.open if e < self.progress.completed]:
            del self.open[e]

    @property
    def finished(self) -> bool:
        return self.epochs is not None and self.progress.completed >= self.epochs

    # ---- handing out -----------------------------------------------------------------------

    def _next_free(self) -> Optional[tuple[int, int]]:
        for e in sorted(self.open):
            epoch = self.open[e]
            while epoch.returned:
                s = epoch.returned.popleft()
                if epoch.split_left[s] > 0 and (e, s) not in self.owner:
                    return e, s
            while epoch.cursor < self.splits:
                s = epoch.cursor
                epoch.cursor += 1
                if self._mine(s) and epoch.split_left[s] > 0 and (e, s) not in self.owner:
                    return e, s
        return None

    def top_up(self, producer: int) -> list[WorkItem]:
        """More splits for ``producer`` until it holds ``ahead`` unfinished ones (as work items to send)."""
        mine = self.assigned.setdefault(producer, {})
        for es in [es for es in mine if self.open.get(es[0]) is None or self.open[es[0]].split_left[es[1]] == 0]:
            del mine[es]
            self.owner.pop(es, None)
        items = []
        while len(mine) < self.ahead:
            free = self._next_free()
            if free is None:
                break
            mine[free] = None
            self.owner[free] = producer
            self.handed_out += 1
            items.append(self._item(*free))
        return items

    def _item(self, e: int, s: int) -> WorkItem:
        epoch = self.open[e]
        start, end = s * self.split, min(self.records, (s + 1) * self.split)
        have = epoch.arrived[epoch.order[start:end]]
        return WorkItem(e, start, end, np.flatnonzero(have).tolist())

    def release(self, producer: int) -> int:
        """Producer ``producer`` is gone (or restarted): its unfinished splits go back; how many."""
        mine = self.assigned.pop(producer, {})
        count = 0
        for e, s in mine:
            self.owner.pop((e, s), None)
            epoch = self.open.get(e)
            if epoch is not None and epoch.split_left[s] > 0:
                epoch.returned.append(s)
                count += 1
        self.released += count
        return count

    def holding(self, producer: int) -> int:
        """Unfinished splits ``producer`` holds."""
        return len(self.assigned.get(producer, {}))

    # ---- what arrives and what the steps take ----------------------------------------------

    def arrived(self, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Which rows of a batch to keep (see the module doc); marks them arrived."""
        epochs, indices = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        valid = np.asarray(mask).astype(bool)
        keep = np.zeros(len(indices), bool)
        for e in np.unique(epochs[indices >= 0]).tolist():
            rows = np.flatnonzero((epochs == e) & (indices >= 0))
            epoch = self.open.get(e)
            if epoch is None:
                self.foreign += int(valid[rows].sum())
                continue
            ok = indices[rows] < self.records
            self.foreign += int((~ok & valid[rows]).sum())
            rows = rows[ok]
            records = indices[rows]
            mine = self._mine_rows(epoch, records)
            self.foreign += int((~mine & valid[rows]).sum())
            rows, records = rows[mine], records[mine]
            first = ~epoch.arrived[records]
            # A record twice in one batch counts once.
            _, unique_at = np.unique(records, return_index=True)
            once = np.zeros(len(records), bool)
            once[unique_at] = True
            first &= once
            self.duplicates += int((~first & valid[rows]).sum())
            fresh_rows, fresh = rows[first], records[first]
            epoch.arrived[fresh] = True
            np.subtract.at(epoch.split_left, epoch.position[fresh] // self.split, 1)
            keep[fresh_rows] = valid[fresh_rows]
            failed = fresh[~valid[fresh_rows]]
            if len(failed):  # the producer could not make them: done, never asked for again
                self.failed += len(failed)
                self._done(epoch, failed)
        self._close_done()
        self._open_epochs()
        return keep

    def _mine_rows(self, epoch: _Epoch, records: np.ndarray) -> np.ndarray:
        if self.world == 1:
            return np.ones(len(records), bool)
        return (epoch.position[records] // self.split) % self.world == self.rank

    def _done(self, epoch: _Epoch, records: np.ndarray) -> None:
        new = records[~epoch.done[records]]
        epoch.done[new] = True
        epoch.left -= len(new)

    def consumed(self, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step took these records (the input state marks them too)."""
        for e in np.unique(epochs).tolist():
            epoch = self.open.get(e)
            if epoch is not None:
                records = indices[epochs == e]
                self._done(epoch, records[(records >= 0) & (records < self.records)])
        self._close_done()
        self._open_epochs()
