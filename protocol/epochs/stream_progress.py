"""One stream's progress in a trainer's input state: the epochs completed, and what of each open epoch was consumed.

Two kinds, chosen by the stream key's epoch order (``StreamKey.order_version``), with one interface:

- ``StreamProgress`` (epoch order 1): a bool bitmap per open epoch over the stream's records ``k`` (one byte per
  record in memory, one bit on the wire): what every Stoker before order 2 kept, for datasets of at most
  ``MAX_MATERIALISED_RECORDS`` records.
- ``RangeProgress`` (epoch order 2): per open epoch, the consumed *epoch positions* as ``PositionRanges``. An elastic
  pool consumes splits, contiguous ranges of positions, so this costs what is in flight plus holes, whatever the
  dataset's size (issue 41).

Both: ``consumed(epoch)`` (opens the epoch), ``mark(epoch, keys)`` (record positions ``k`` in order 1, epoch positions
in order 2), ``whole(epoch)``, ``consumed_in(epoch)`` (without opening it), ``close_complete``, ``advance``, ``copy``,
``count``. Not thread-safe: the ledger's lock guards them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stoker.protocol.epochs.epoch_order import LazyOrder
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.epochs.stream_key import check_materialisable

#: Positions turned into records at a time by ``consumed_records``: its temporaries stay this small at any size.
RECORDS_CHUNK = 1 << 20


class _EpochsClosing:
    """What both kinds do alike with their epochs: ``completed`` and ``open`` are theirs, ``whole`` says when an
    open epoch is all consumed."""

    completed: int
    open: dict

    def whole(self, epoch: int) -> bool:
        raise NotImplementedError

    def close_complete(self) -> list[int]:
        """Move every fully consumed epoch at the front into ``completed``; returns those epochs."""
        closed = []
        while self.completed in self.open and self.whole(self.completed):
            del self.open[self.completed]
            closed.append(self.completed)
            self.completed += 1
        return closed

    def advance(self, completed: int) -> None:
        """Every epoch below ``completed`` is complete (a producer's status, or the pool's scheduler, says so):
        what they kept goes."""
        if completed > self.completed:
            for e in [e for e in self.open if e < completed]:
                del self.open[e]
            self.completed = completed


@dataclass
class StreamProgress(_EpochsClosing):
    """Completed epochs (all below ``completed``) and the consumed records of each open epoch."""

    size: int
    completed: int = 0
    open: dict[int, np.ndarray] = field(default_factory=dict)  # epoch -> bool [size]

    def consumed(self, epoch: int) -> np.ndarray:
        """The bitmap of ``epoch`` (all True for a completed one, all False for one not begun)."""
        if epoch >= self.completed and epoch in self.open:
            return self.open[epoch]
        check_materialisable(self.size, "an open epoch's bitmap")
        if epoch < self.completed:
            return np.ones(self.size, bool)
        bitmap = self.open[epoch] = np.zeros(self.size, bool)  # not setdefault: that allocates on every call
        return bitmap

    def mark(self, epoch: int, local: np.ndarray) -> None:
        if epoch >= self.completed:
            self.consumed(epoch)[local] = True

    def whole(self, epoch: int) -> bool:
        """Whether every record of ``epoch`` was consumed (a completed epoch's were)."""
        return epoch < self.completed or (epoch in self.open and bool(self.open[epoch].all()))

    def consumed_in(self, epoch: int) -> int:
        """Records of ``epoch`` consumed, without opening it."""
        if epoch < self.completed:
            return self.size
        return int(self.open[epoch].sum()) if epoch in self.open else 0

    def copy(self) -> "StreamProgress":
        return StreamProgress(self.size, self.completed, {e: b.copy() for e, b in self.open.items()})

    def count(self) -> int:
        """Records consumed in open epochs."""
        return int(sum(b.sum() for b in self.open.values()))


@dataclass
class RangeProgress(_EpochsClosing):
    """Completed epochs (all below ``completed``) and the consumed positions of each open epoch (epoch order 2)."""

    size: int
    completed: int = 0
    open: dict[int, PositionRanges] = field(default_factory=dict)  # epoch -> consumed positions

    def consumed(self, epoch: int) -> PositionRanges:
        """The consumed positions of ``epoch`` (every position for a completed one; opens one not begun)."""
        if epoch < self.completed:
            whole = PositionRanges(self.size)
            whole.add_range(0, self.size)
            return whole
        if epoch not in self.open:
            self.open[epoch] = PositionRanges(self.size)
        return self.open[epoch]

    def mark(self, epoch: int, positions: np.ndarray) -> None:
        if epoch >= self.completed:
            self.consumed(epoch).add(np.asarray(positions, np.int64))

    def whole(self, epoch: int) -> bool:
        """Whether every position of ``epoch`` was consumed (a completed epoch's were)."""
        return epoch < self.completed or (epoch in self.open and self.open[epoch].is_full())

    def consumed_in(self, epoch: int) -> int:
        """Positions of ``epoch`` consumed, without opening it."""
        if epoch < self.completed:
            return self.size
        return self.open[epoch].count() if epoch in self.open else 0

    def copy(self) -> "RangeProgress":
        return RangeProgress(self.size, self.completed, {e: r.copy() for e, r in self.open.items()})

    def count(self) -> int:
        """Positions consumed in open epochs."""
        return sum(r.count() for r in self.open.values())


def consumed_records(ranges: PositionRanges, order: LazyOrder, epoch: int) -> np.ndarray:
    """bool ``[records]`` over a stream's records ``k``: those at the positions in ``ranges`` of ``epoch``
    (``order`` the stream's ``StreamKey.lazy_order()``). What a fixed shard's producer keeps per open epoch, made
    from a hello's ranges (epoch order 2): O(the stream's records) for the bitmap, ``RECORDS_CHUNK`` at a time
    for the rest, never the epoch's whole order. TooManyRecordsError beyond ``MAX_MATERIALISED_RECORDS``;
    ValueError when ``ranges`` are not over the stream's positions."""
    size = order.table.records
    if ranges.limit != size:
        raise ValueError(f"consumed positions over [0, {ranges.limit}) do not belong to a stream of {size} records")
    check_materialisable(size, "a fixed shard's consumed records of an open epoch")
    bitmap = np.zeros(size, bool)
    starts, ends = _pieces(ranges.starts, ranges.ends)
    group = (np.cumsum(ends - starts) - 1) // RECORDS_CHUNK  # pieces of about RECORDS_CHUNK positions together
    bounds = np.flatnonzero(np.diff(group)) + 1
    for lo, hi in zip(np.concatenate(([0], bounds)).tolist(), np.concatenate((bounds, [len(starts)])).tolist()):
        lengths = ends[lo:hi] - starts[lo:hi]
        first = np.cumsum(lengths) - lengths  # where each piece begins among the group's positions
        positions = np.repeat(starts[lo:hi] - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
        bitmap[order.at(epoch, positions)] = True
    return bitmap


def _pieces(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges cut into pieces of at most ``RECORDS_CHUNK`` positions (one long run, too, is expanded a chunk at a
    time)."""
    pieces = -(-(ends - starts) // RECORDS_CHUNK)
    of = np.repeat(np.arange(len(starts)), pieces)
    nth = np.arange(len(of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    piece_starts = starts[of] + nth * RECORDS_CHUNK
    return piece_starts, np.minimum(piece_starts + RECORDS_CHUNK, ends[of])
