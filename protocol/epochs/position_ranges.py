"""Which positions of an epoch are in a set, kept as sorted disjoint ranges: exact mode's consumption at any size.

An elastic pool consumes *splits*, contiguous ranges of epoch positions, mostly in order, so the positions a
trainer's steps consumed are a few long runs plus holes (records rejected, re-served or out of order). A
``PositionRanges`` stores them as two sorted int64 arrays ``starts``/``ends`` of half-open ranges that are
disjoint and never adjacent (merged: the one canonical form), so its size follows the work in flight and the
holes, never the epoch's length. A bool bitmap of the same epoch costs one byte per record (2 GB at 10^9).

Wire form (``to_wire``/``from_wire``), for checkpoints and messages: the ranges ``[s0, e0), [s1, e1), ...`` as
the unsigned integers ``s0, e0-s0, s1-e0, e1-s1, s2-e1, ...`` (first start, then each range's length and the
gap before the next), each an unsigned LEB128 varint (7 bits per byte, least significant group first, high bit
set on every byte but the last, minimal: at most 6 bytes, since every value is at most 2**40), the whole
sequence zlib-compressed. The empty set is ``zlib.compress(b"")``. Lengths and gaps after the first are >= 1
(a set is written merged), so one set has one varint sequence.
"""

from __future__ import annotations

import zlib

import numpy as np

from stoker.protocol.epochs.varints import MAX_VARINT_BYTES, decode_varints, encode_varints

MAX_LIMIT = 1 << 40  # positions are below 2**40: issue 41's record indices
MAX_RANGES_CAP = 1 << 22  # 2**23 values of <= 2**40 sum below 2**64: from_wire's cumulative sum cannot wrap
_EMPTY = np.zeros(0, np.int64)


def _canonical(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges sorted by start (overlapping or adjacent allowed) merged into disjoint, non-adjacent ones. O(n)."""
    if len(starts) < 2:
        return starts, ends
    reach = np.maximum.accumulate(ends)  # how far the ranges so far reach; a start beyond it opens a new range
    opens = np.flatnonzero(starts[1:] > reach[:-1]) + 1
    return starts[np.concatenate(([0], opens))], reach[np.concatenate((opens - 1, [len(starts) - 1]))]


def _interleave(a_starts: np.ndarray, a_ends: np.ndarray, b_starts: np.ndarray,
                b_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two lists of ranges, each sorted by start, as one list sorted by start: O(len(b) log len(a) + a + b),
    no sort of the whole."""
    slots = np.searchsorted(a_starts, b_starts, side="right") + np.arange(len(b_starts))
    taken = np.zeros(len(a_starts) + len(b_starts), bool)
    taken[slots] = True
    starts, ends = np.empty(len(taken), np.int64), np.empty(len(taken), np.int64)
    starts[slots], ends[slots] = b_starts, b_ends
    starts[~taken], ends[~taken] = a_starts, a_ends
    return starts, ends


def _clip_arguments(start: int, end: int, limit: int) -> None:
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (start, end)):
        raise TypeError(f"start and end must be ints, got {start!r} and {end!r}")
    if not 0 <= start <= end <= limit:
        raise ValueError(f"[{start}, {end}) is not a range within [0, {limit}): need 0 <= start <= end <= limit")


class PositionRanges:
    """A set of int positions in ``[0, limit)`` held as sorted, disjoint, non-adjacent ranges ``[starts[i],
    ends[i])`` (read-only views: change the set through its methods). Costs O(ranges) memory whatever ``limit``
    is. Not thread-safe: one writer, or a lock held by the caller. Complexities are for R ranges."""

    __hash__ = None  # mutable

    def __init__(self, limit: int) -> None:
        """The empty set over ``[0, limit)``; ValueError unless ``0 <= limit <= 2**40``."""
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 0 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be an int in [0, 2**40], got {limit!r}")
        self.limit = int(limit)
        self._starts, self._ends = _EMPTY, _EMPTY
        self._count = 0

    @property
    def starts(self) -> np.ndarray:
        view = self._starts.view()
        view.flags.writeable = False
        return view

    @property
    def ends(self) -> np.ndarray:
        view = self._ends.view()
        view.flags.writeable = False
        return view

    @property
    def range_count(self) -> int:
        """How many ranges hold the set (its memory, and its wire size, grow with this)."""
        return len(self._starts)

    def count(self) -> int:
        """How many positions are in the set. O(1)."""
        return self._count

    def _positions(self, positions: np.ndarray) -> np.ndarray:
        """``positions`` as int64, checked: TypeError unless integers, ValueError naming the first outside."""
        array = np.asarray(positions)
        if array.dtype.kind not in "iu":
            raise TypeError(f"positions must be an integer array, got dtype {array.dtype}")
        if array.size and (array.min() < 0 or array.max() >= self.limit):  # two reductions, no bool array
            outside = (array < 0) | (array >= self.limit)
            bad = array.reshape(-1)[np.argmax(outside.reshape(-1))]
            raise ValueError(f"position {int(bad)} is outside [0, {self.limit}): positions are "
                             f"indices into the epoch's order")
        return array.astype(np.int64, copy=False)

    def _insert(self, run_starts: np.ndarray, run_ends: np.ndarray) -> int:
        """Merges sorted, disjoint runs in; returns how many positions were new. Only the ranges the runs span
        are merged (O(log R + span + runs)); the rest are copied as they are (O(R), a memcpy)."""
        low = int(np.searchsorted(self._ends, run_starts[0], side="left"))  # first range that may touch
        high = int(np.searchsorted(self._starts, run_ends[-1], side="right"))  # past the last that may touch
        old_starts, old_ends = self._starts[low:high], self._ends[low:high]
        if low == high:  # the runs fall in one gap, touching nothing (the usual batch): they are canonical
            starts, ends = run_starts, run_ends
        elif len(run_starts) == 1:  # one run (a batch of consecutive positions) touches every range it spans
            starts, ends = np.minimum(run_starts, old_starts[:1]), np.maximum(run_ends, old_ends[-1:])
        else:
            starts, ends = _canonical(*_interleave(old_starts, old_ends, run_starts, run_ends))
        new = int((ends - starts).sum()) - int((old_ends - old_starts).sum())
        self._starts = np.concatenate((self._starts[:low], starts, self._starts[high:]))
        self._ends = np.concatenate((self._ends[:low], ends, self._ends[high:]))
        self._count += new
        return new

    def add(self, positions: np.ndarray) -> int:
        """Adds positions (any order, duplicates allowed); returns how many were not in the set before.
        O(B log B + log R + R) for a batch of B. TypeError for a non-integer array; ValueError if any position
        is outside ``[0, limit)``, and then the set is unchanged."""
        batch = np.sort(self._positions(positions), axis=None)  # np.unique costs several times a sort here
        if len(batch) == 0:
            return 0
        batch = batch[np.concatenate(([True], batch[1:] != batch[:-1]))]
        breaks = np.flatnonzero(np.diff(batch) != 1) + 1  # where a run of consecutive positions ends
        run_starts = batch[np.concatenate(([0], breaks))]
        run_ends = batch[np.concatenate((breaks - 1, [len(batch) - 1]))] + 1
        return self._insert(run_starts, run_ends)

    def add_range(self, start: int, end: int) -> int:
        """Adds every position of ``[start, end)``; returns how many were new. O(log R + R); ValueError
        unless ``0 <= start <= end <= limit``."""
        _clip_arguments(start, end, self.limit)
        if start == end:
            return 0
        return self._insert(np.array([start], np.int64), np.array([end], np.int64))

    def contains(self, positions: np.ndarray) -> np.ndarray:
        """A bool per position, in ``positions``' shape: is it in the set. Positions outside ``[0, limit)``
        are never in it (False, no error). O(B log R). TypeError for a non-integer array."""
        array = np.asarray(positions)
        if array.dtype.kind not in "iu":
            raise TypeError(f"positions must be an integer array, got dtype {array.dtype}")
        if len(self._ends) == 0:
            return np.zeros(array.shape, bool)
        inside = (array >= 0) & (array < self.limit)
        probe = np.where(inside, array, 0).astype(np.int64, copy=False)
        index = np.searchsorted(self._starts, probe, side="right") - 1
        return inside & (index >= 0) & (probe < self._ends[np.maximum(index, 0)])

    def covers(self, start: int, end: int) -> bool:
        """Whether every position of ``[start, end)`` is in the set (True when empty). O(log R); ValueError
        unless ``0 <= start <= end <= limit``."""
        _clip_arguments(start, end, self.limit)
        if start == end:
            return True
        index = int(np.searchsorted(self._starts, start, side="right")) - 1
        return index >= 0 and int(self._ends[index]) >= end  # merged: a covered range lies in one range

    def _clipped(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        _clip_arguments(start, end, self.limit)
        low = int(np.searchsorted(self._ends, start, side="right"))  # first range ending after start
        high = int(np.searchsorted(self._starts, end, side="left"))  # past the last starting before end
        return np.maximum(self._starts[low:high], start), np.minimum(self._ends[low:high], end)

    def within(self, start: int, end: int) -> np.ndarray:
        """The set's positions inside ``[start, end)``, sorted, int64 (a split's skip list). Memory and time
        O(log R + r + k) for r ranges and k positions found, k <= end - start: ask for a split's window, not
        an epoch. ValueError unless ``0 <= start <= end <= limit``."""
        starts, ends = self._clipped(start, end)
        lengths = ends - starts
        total = int(lengths.sum())
        # position j of the output = j + (the start of its range - how many positions came before that range)
        offsets = starts - np.concatenate(([0], np.cumsum(lengths)[:-1]))
        return np.arange(total, dtype=np.int64) + np.repeat(offsets, lengths)

    def missing(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The gaps of the set inside ``[start, end)`` as sorted, disjoint, non-adjacent ``(starts, ends)``.
        O(log R + r). ValueError unless ``0 <= start <= end <= limit``."""
        starts, ends = self._clipped(start, end)
        gap_starts = np.concatenate(([start], ends)).astype(np.int64)
        gap_ends = np.concatenate((starts, [end])).astype(np.int64)
        keep = gap_starts < gap_ends  # only the first and last gap can be empty: ranges are not adjacent
        return gap_starts[keep], gap_ends[keep]

    def first_missing(self, start: int = 0) -> int:
        """The smallest position ``>= start`` not in the set, or ``limit`` if there is none. O(log R);
        ValueError unless ``0 <= start <= limit``."""
        _clip_arguments(start, start, self.limit)
        index = int(np.searchsorted(self._starts, start, side="right")) - 1
        if index >= 0 and int(self._ends[index]) > start:
            return int(self._ends[index])  # a range's end is never in the set: ranges are not adjacent
        return start

    def is_full(self) -> bool:
        """Whether every position of ``[0, limit)`` is in the set. O(1)."""
        return self._count == self.limit

    def union(self, other: PositionRanges) -> PositionRanges:
        """A new set holding the positions of both. O((R1 + R2) log). ValueError if the limits differ."""
        if not isinstance(other, PositionRanges) or other.limit != self.limit:
            raise ValueError(f"union needs a PositionRanges over the same limit {self.limit}, got {other!r}")
        merged = PositionRanges(self.limit)
        if other.range_count:
            merged._set(*_canonical(*_interleave(self._starts, self._ends, other._starts, other._ends)))
        else:
            merged._set(self._starts, self._ends)
        return merged

    @classmethod
    def from_ranges(cls, starts: np.ndarray, ends: np.ndarray, limit: int) -> PositionRanges:
        """The set of ranges ``[starts[i], ends[i])``, sorted by start (overlapping or adjacent allowed; empty
        ones dropped). O(n). ValueError for ranges outside ``[0, limit)`` or ending before they start."""
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        if (ends < starts).any():
            raise ValueError("a range ends before it starts")
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        ranges = cls(limit)
        if len(starts):
            if starts.min() < 0 or ends.max() > limit or (np.diff(starts) < 0).any():
                raise ValueError(f"ranges must be sorted by start and within [0, {limit})")
            ranges._set(*_canonical(starts, ends))
        return ranges

    def _set(self, starts: np.ndarray, ends: np.ndarray) -> None:
        """Takes canonical ranges as they are (the callers made them so)."""
        self._starts, self._ends = starts.astype(np.int64), ends.astype(np.int64)
        self._count = int((self._ends - self._starts).sum())

    def copy(self) -> PositionRanges:
        """An independent copy. O(R)."""
        twin = PositionRanges(self.limit)
        twin._set(self._starts, self._ends)
        return twin

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PositionRanges):
            return NotImplemented
        return (self.limit == other.limit and np.array_equal(self._starts, other._starts)
                and np.array_equal(self._ends, other._ends))

    def __repr__(self) -> str:
        shown = ", ".join(f"[{s}, {e})" for s, e in zip(self._starts[:4].tolist(), self._ends[:4].tolist()))
        more = f", ... {self.range_count - 4} more" if self.range_count > 4 else ""
        return f"PositionRanges(limit={self.limit}, count={self._count}, ranges={{{shown}{more}}})"

    @classmethod
    def from_bitmap(cls, bitmap: np.ndarray) -> PositionRanges:
        """The set of the True positions of a 1-D bool array, over ``limit = len(bitmap)`` (converting an old
        bitmap state; O(limit) memory and time). ValueError unless 1-D bool of at most 2**40 entries."""
        array = np.asarray(bitmap)
        if array.dtype != bool or array.ndim != 1:
            raise ValueError(f"bitmap must be a 1-D bool array, got {array.dtype} of shape {array.shape}")
        ranges = cls(len(array))
        steps = np.diff(np.concatenate(([0], array.view(np.int8), [0])))
        ranges._set(np.flatnonzero(steps == 1), np.flatnonzero(steps == -1))
        return ranges

    def to_bitmap(self) -> np.ndarray:
        """The set as a bool array of ``limit`` entries: O(limit) memory, for small sets and tests only."""
        steps = np.zeros(self.limit + 1, np.int8)
        steps[self._starts], steps[self._ends] = 1, -1  # never the same index: ranges are not adjacent
        return np.cumsum(steps[:-1], dtype=np.int8).astype(bool)

    def to_wire(self) -> bytes:
        """The set in the module's wire form (varints of start, lengths and gaps, zlib'ed). O(R)."""
        values = np.empty(2 * self.range_count, np.uint64)
        if self.range_count:
            values[0::2] = self._starts - np.concatenate(([0], self._ends[:-1]))
            values[1::2] = self._ends - self._starts
        return zlib.compress(encode_varints(values))

    @classmethod
    def from_wire(cls, data: bytes, limit: int, max_ranges: int = 1 << 20) -> PositionRanges:
        """The set ``to_wire`` wrote, over ``[0, limit)``. A parser of untrusted bytes: it inflates at most
        ``12 * max_ranges`` bytes (checked while inflating, before anything is allocated for the ranges), so
        memory and CPU are bounded by ``len(data)`` and ``max_ranges``, never by ``limit``. ValueError, naming
        what is wrong, for: not zlib, truncated zlib, bytes after the zlib stream, more than ``max_ranges``
        ranges, a truncated or over-long varint (non-minimal, or longer than 2**40 needs), a range's length
        missing, a zero-length range, a zero gap (adjacent ranges not merged), a range reaching past ``limit``.
        ``max_ranges`` must be in ``[0, 2**22]``."""
        if isinstance(max_ranges, bool) or not isinstance(max_ranges, int) or not 0 <= max_ranges <= MAX_RANGES_CAP:
            raise ValueError(f"max_ranges must be an int in [0, 2**22], got {max_ranges!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"position ranges: data must be bytes, got {type(data).__name__}")
        ranges = cls(limit)
        cap = 2 * max_ranges * MAX_VARINT_BYTES
        inflater = zlib.decompressobj()
        try:
            payload = inflater.decompress(data, cap + 1)
        except zlib.error as exc:
            raise ValueError(f"position ranges: not a zlib stream ({exc})") from None
        if len(payload) > cap:
            raise ValueError(f"position ranges: inflates past {cap} bytes, more than max_ranges={max_ranges} "
                             f"ranges can need; raise max_ranges if the set is truly that fragmented")
        if not inflater.eof:
            raise ValueError("position ranges: the zlib stream is truncated")
        if inflater.unused_data:
            raise ValueError(f"position ranges: {len(inflater.unused_data)} bytes of trailing garbage after the "
                             f"zlib stream")
        values = decode_varints(payload, 2 * max_ranges)
        if len(values) % 2:
            raise ValueError("position ranges: the last range's length is missing (an odd number of varints)")
        if (values > ranges.limit).any():
            raise ValueError(f"position ranges: a start, length or gap exceeds the limit {ranges.limit}")
        if (values[1::2] == 0).any():
            raise ValueError("position ranges: a zero-length range (the writer must drop empty ranges)")
        if (values[2::2] == 0).any():
            raise ValueError("position ranges: a zero gap between ranges (adjacent ranges must be merged)")
        bounds = np.cumsum(values)  # uint64: at most 2**23 values of <= 2**40 each, so it cannot wrap
        if len(bounds) and int(bounds[-1]) > ranges.limit:
            raise ValueError(f"position ranges: a range ends at {int(bounds[-1])}, past the limit {ranges.limit}")
        ranges._set(bounds[0::2], bounds[1::2])
        return ranges
