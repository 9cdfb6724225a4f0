"""Which records of which epochs a trainer's steps have consumed: the input state of exact mode.

A *stream* is what one producer serves: shard ``I/N`` of a dataset of ``count``
records, shuffled with ``seed``. Its key is ``"I/N:count:seed"``; the shard's
records are ``I, I+N, I+2N, ...``, numbered ``k = 0, 1, 2, ...`` within the shard.
An elastic pool's key is ``"splits:count:seed"``. Either ends in ``":BxW"`` for a dataset
stored in shards of ``B`` records: a fixed shard ``I/N`` is then the dataset's shards
``j % N == I``, whole, and epochs are two-level shuffles (``epoch_order``: the shards, then
the records within each window of ``W`` shards).

``StreamProgress`` holds the number of completed epochs and, for each epoch still
open, a bitmap over ``k`` of the records consumed. ``InputState`` maps stream keys
to progress and serialises to a few bytes (msgpack; bitmaps packed and zlib'ed):
a fully consumed or untouched epoch costs almost nothing, a half-consumed one at
most one bit per record (125 KB per million records before compression).
Nothing is ever unpickled; ``InputState.from_bytes`` validates every field and
raises ValueError naming what is wrong.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping, Sequence

import msgpack
import numpy as np

FORMAT = "stoker-input-state"
VERSION = 1
_KEY_RE = re.compile(r"^(\d+)/(\d+):(\d+):(-?\d+)(?::(\d+)x(\d+))?$")
_SPLITS_RE = re.compile(r"^splits:(\d+):(-?\d+)(?::(\d+)x(\d+))?$")
MAX_WINDOW = 1 << 16  # shards in one shuffle window
MAX_STATE_BYTES = 256 * 1024 * 1024
#: Dataset sizes reach this and record indices stay below it, in every key, message and state (issue 41): naming
#: a record costs nothing; what a message or state expands to is bounded apart, before allocating.
MAX_RECORDS = 2**40
#: Records of a dataset whose epochs are ordered or tracked one entry per record (epoch order 1's permutation,
#: open epochs' bitmaps): ``check_materialisable``, the one check, runs before such arrays are built.
MAX_MATERIALISED_RECORDS = 10**8
#: Bits the open epochs of one state may unpack to, all streams together (1 GiB of booleans): a state of today's
#: largest job (10**8 records, two epochs open) is 2e8; a hostile one of 4096 streams could otherwise ask 10**15.
MAX_STATE_BITS = 2**30


class TooManyRecordsError(ValueError):
    """A dataset too large for one entry per record (epoch order 1); the text names the limit and the way out."""


def check_materialisable(records: int, what: str) -> None:
    """TooManyRecordsError naming ``what`` unless ``records`` fit one entry each (``MAX_MATERIALISED_RECORDS``)."""
    if records > MAX_MATERIALISED_RECORDS:
        raise TooManyRecordsError(f"{what} holds {records:,} records: epoch order 1 keeps one entry per record and "
                                  f"serves at most {MAX_MATERIALISED_RECORDS:,} (10**8) records; order 2 (lazy) is "
                                  "needed beyond")


def epoch_order(shard_records: np.ndarray, seed: int, epoch: int, shuffle: bool = True, block: int = 0,
                window: int = 1) -> np.ndarray:
    """The shard's records in epoch ``epoch``'s order: a permutation seeded by ``(seed, epoch)``.

    ``block`` > 0: a two-level shuffle of a dataset stored in blocks (its shards) of ``block`` consecutive
    records (the last may hold fewer): the blocks are permuted, then the records within each *window* of
    ``window`` consecutive blocks of that permutation, so consecutive positions come from few shards. With
    ``block`` 0 the whole shard is one permutation.

    Part of the protocol: an elastic pool's work messages name positions in this order, so
    producers and trainers must compute it alike (NumPy's PCG64: ``permutation`` for the flat order; for the
    two-level one, ``permutation`` of the blocks then ``integers(0, 2**32, n)`` as the sort keys within windows,
    ties broken by position).
    """
    if not shuffle:
        return shard_records
    rng = np.random.default_rng([seed, epoch])
    if block <= 0:
        return rng.permutation(shard_records)
    records = len(shard_records)
    blocks = -(-records // block)
    rank = np.empty(blocks, np.int64)
    rank[rng.permutation(blocks)] = np.arange(blocks, dtype=np.int64)
    window_of = rank[np.arange(records, dtype=np.int64) // block] // max(1, window)
    keys = (window_of << 32) | rng.integers(0, 2**32, records, dtype=np.int64)
    return shard_records[np.argsort(keys, kind="stable")]


def rows_by_epoch(epochs: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``[(epoch, rows of it)]`` of a batch's epoch column, epochs ascending. A batch nearly always holds one
    epoch: that case costs one comparison, not a sort."""
    epochs = np.asarray(epochs)
    if not epochs.size:
        return []
    first = epochs[0]
    if (epochs == first).all():
        return [(int(first), np.arange(epochs.size))]
    return [(int(e), np.flatnonzero(epochs == e)) for e in np.unique(epochs)]


@dataclass(frozen=True)
class StreamKey:
    """Shard ``index/count`` of a dataset of ``records`` records, shuffled with ``seed``.

    ``splits``: the whole dataset shared by an elastic pool (``--shard auto``): each trainer hands
    out splits of every epoch to whichever producers are there (``"splits:count:seed"``). ``block``: the
    dataset is stored in shards of this many records (0: not known, one LMDB); then a fixed shard ``I/N`` is the
    dataset's shards ``j`` with ``j % N == I``, whole, and every epoch is a two-level shuffle with windows of
    ``window`` shards (``epoch_order``; the key ends in ``":BxW"``).
    """

    index: int
    count: int
    records: int
    seed: int
    splits: bool = False
    block: int = 0
    window: int = 1

    @classmethod
    def parse(cls, text: str) -> "StreamKey":
        match = _SPLITS_RE.match(text)
        fixed = None if match else _KEY_RE.match(text)
        if not match and not fixed:
            raise ValueError(f"stream key {text!r} is not I/N:count:seed or splits:count:seed (either with :BxW)")
        groups = (match or fixed).groups()  # type: ignore[union-attr]
        block, window = (int(groups[-2]), int(groups[-1])) if groups[-2] is not None else (0, 1)
        if groups[-2] is not None and not (1 <= block <= MAX_RECORDS and 1 <= window <= MAX_WINDOW):
            raise ValueError(f"stream key {text!r} names an invalid shard layout (BxW: B >= 1 records per "
                             f"shard, W 1-{MAX_WINDOW} shards per window)")
        if match:
            records, seed = int(groups[0]), int(groups[1])
            if not 0 <= records <= MAX_RECORDS:
                raise ValueError(f"stream key {text!r} names an invalid dataset size (0 to 2**40 records)")
            return cls(0, 1, records, seed, splits=True, block=block, window=window)
        index, count, records, seed = (int(g) for g in groups[:4])
        if count < 1 or not 0 <= index < count or not 0 <= records <= MAX_RECORDS:
            raise ValueError(f"stream key {text!r} names an invalid shard (I/N with 0 <= I < N, 0 to 2**40 records)")
        return cls(index, count, records, seed, block=block, window=window)

    @staticmethod
    def names_pool(text: str) -> bool:
        """Whether stream key ``text`` names an elastic pool (``parse(text).splits``), without parsing it: a
        trainer asks this of every batch's stream. False for "" (not known yet) and for a fixed shard's key."""
        return text.startswith("splits:")

    def __str__(self) -> str:
        layout = f":{self.block}x{self.window}" if self.block else ""
        if self.splits:
            return f"splits:{self.records}:{self.seed}{layout}"
        return f"{self.index}/{self.count}:{self.records}:{self.seed}{layout}"

    @property
    def shards(self) -> int:
        """Shards of the dataset's layout (``block``); 0 when the layout is not known."""
        return -(-self.records // self.block) if self.block else 0

    def _strided(self) -> bool:
        return not self.splits and self.count > 1

    def check_materialisable(self) -> None:
        """TooManyRecordsError unless this stream's dataset fits epoch order 1 (one entry per record)."""
        check_materialisable(self.records, f"the dataset of stream {self}")

    def stream_records(self) -> np.ndarray:
        """int64 [size]: the dataset's records this stream serves, ascending (position ``k`` -> record).
        TooManyRecordsError, before allocating, beyond ``MAX_MATERIALISED_RECORDS`` (``order`` too)."""
        self.check_materialisable()
        if not self._strided():
            return np.arange(self.records, dtype=np.int64)
        if not self.block:
            return np.arange(self.index, self.records, self.count, dtype=np.int64)
        blocks = np.arange(self.index, self.shards, self.count, dtype=np.int64)
        records = (blocks[:, None] * self.block + np.arange(self.block, dtype=np.int64)[None, :]).ravel()
        return records[records < self.records]

    def order(self, epoch: int) -> np.ndarray:
        """The stream's records in epoch ``epoch``'s order (``epoch_order``; a pool's: the whole dataset's)."""
        return epoch_order(self.stream_records(), self.seed, epoch, block=self.block, window=self.window)

    @property
    def size(self) -> int:
        """Records in the shard."""
        if not self._strided() or not self.block:
            return len(range(self.index, self.records, self.count))
        blocks = len(range(self.index, self.shards, self.count))
        short = self.shards * self.block - self.records  # what the dataset's last shard lacks
        return blocks * self.block - (short if (self.shards - 1) % self.count == self.index and blocks else 0)

    def owns(self, indices: np.ndarray) -> np.ndarray:
        """bool per record index: whether this stream serves it."""
        indices = np.asarray(indices, np.int64)
        ok = (indices >= 0) & (indices < self.records)
        if not self._strided():
            return ok
        if self.block:
            return ok & ((indices // self.block) % self.count == self.index)
        return ok & ((indices - self.index) % self.count == 0)

    def local(self, indices: np.ndarray) -> np.ndarray:
        """Record indices -> positions ``k`` within the shard; ValueError for records of other shards."""
        indices = np.asarray(indices, np.int64)
        if not indices.size:
            return indices
        if not self.owns(indices).all():
            raise ValueError(f"record indices outside shard {self}")
        if not self._strided():
            return indices.copy()  # the whole dataset (one shard, an elastic pool): positions are the indices
        if self.block:
            return (indices // self.block) // self.count * self.block + indices % self.block
        return (indices - self.index) // self.count


@dataclass
class StreamProgress:
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

    def close_complete(self) -> list[int]:
        """Move every fully consumed epoch at the front into ``completed``; returns those epochs."""
        closed = []
        while self.completed in self.open and self.open[self.completed].all():
            del self.open[self.completed]
            closed.append(self.completed)
            self.completed += 1
        return closed

    def advance(self, completed: int) -> None:
        """Every epoch below ``completed`` is complete (a producer's status says so): their bitmaps go."""
        if completed > self.completed:
            for e in [e for e in self.open if e < completed]:
                del self.open[e]
            self.completed = completed

    def copy(self) -> "StreamProgress":
        return StreamProgress(self.size, self.completed, {e: b.copy() for e, b in self.open.items()})

    def count(self) -> int:
        """Records consumed in open epochs."""
        return int(sum(b.sum() for b in self.open.values()))


def _unpacked_sizes(raw_streams: dict) -> dict:
    """Each stream's size, checked before any bitmap is unpacked: ValueError for a key that is not a stream's,
    open epochs of a dataset too large for bitmaps, or bitmaps that unpack to over ``MAX_STATE_BITS`` together."""
    sizes, bits = {}, 0
    for key, raw in raw_streams.items():
        if not isinstance(key, str):
            raise ValueError(f"input state: stream key {key!r} is not a string")
        stream = StreamKey.parse(key)
        sizes[key], opened = stream.size, raw.get("open") if isinstance(raw, dict) else None
        if isinstance(opened, dict) and opened:
            stream.check_materialisable()
            bits += stream.size * len(opened)
    if bits > MAX_STATE_BITS:
        raise ValueError(f"input state: its open epochs unpack to {bits:,} bits, over {MAX_STATE_BITS:,}: not a state "
                         "a job saved (one of 10**8 records with two epochs open holds 2e8)")
    return sizes


@lru_cache(maxsize=256)
def _parse_key(text: str) -> "StreamKey":
    """``StreamKey.parse``, remembered: a step's report names the same few streams every time."""
    return StreamKey.parse(text)


class InputState:
    """A trainer's progress through every stream it reads (see the module doc)."""

    def __init__(self, streams: Mapping[str, StreamProgress] | None = None) -> None:
        self.streams: dict[str, StreamProgress] = dict(streams or {})

    def progress(self, key: str) -> StreamProgress:
        if key not in self.streams:
            self.streams[key] = StreamProgress(_parse_key(key).size)
        return self.streams[key]

    def mark(self, key: str, epochs: Sequence[int] | np.ndarray, indices: Sequence[int] | np.ndarray) -> None:
        """Record that ``indices`` (of ``epochs``, row by row) were consumed."""
        stream = _parse_key(key)
        progress = self.progress(key)
        epochs, indices = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        for epoch, rows in rows_by_epoch(epochs):
            progress.mark(epoch, stream.local(indices[rows]))

    def copy(self) -> "InputState":
        return InputState({k: p.copy() for k, p in self.streams.items()})

    # ---- serialisation -------------------------------------------------------------------

    def to_wire(self) -> dict:
        """Plain msgpack-able form (also what the control channel carries)."""
        streams = {}
        for key, progress in self.streams.items():
            streams[key] = {"completed": progress.completed, "open": {
                int(e): zlib.compress(np.packbits(b).tobytes(), 6) for e, b in progress.open.items()}}
        return {"format": FORMAT, "version": VERSION, "streams": streams}

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def from_wire(cls, body: object) -> "InputState":
        """Validate and load ``to_wire()``'s form; ValueError naming the problem."""
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"not a Stoker input state (format {FORMAT!r} missing)")
        if body.get("version") != VERSION:
            raise ValueError(f"input state version {body.get('version')!r}, this Stoker reads {VERSION}")
        raw_streams = body.get("streams")
        if not isinstance(raw_streams, dict) or len(raw_streams) > 4096:
            raise ValueError("input state 'streams' must be a map of at most 4096 streams")
        streams, sizes = {}, _unpacked_sizes(raw_streams)
        for key, raw in raw_streams.items():
            size = sizes[key]
            completed, opened = (raw.get("completed"), raw.get("open")) if isinstance(raw, dict) else (None, None)
            if not isinstance(completed, int) or isinstance(completed, bool) or not 0 <= completed < 2**31:
                raise ValueError(f"stream {key}: 'completed' must be an epoch count")
            if not isinstance(opened, dict) or len(opened) > 64:
                raise ValueError(f"stream {key}: 'open' must map at most 64 epochs to bitmaps")
            progress = StreamProgress(size, completed)
            for epoch, packed in opened.items():
                if not isinstance(epoch, int) or isinstance(epoch, bool) or not completed <= epoch < 2**31:
                    raise ValueError(f"stream {key}: open epoch {epoch!r} is not at or after {completed}")
                if not isinstance(packed, bytes):
                    raise ValueError(f"stream {key} epoch {epoch}: bitmap must be bytes")
                try:
                    raw_bits = zlib.decompressobj().decompress(packed, (size + 7) // 8 + 1)
                except zlib.error as exc:
                    raise ValueError(f"stream {key} epoch {epoch}: bitmap does not decompress ({exc})") from None
                if len(raw_bits) != (size + 7) // 8:
                    raise ValueError(f"stream {key} epoch {epoch}: bitmap holds {len(raw_bits)} bytes, the shard "
                                     f"needs {(size + 7) // 8}")
                progress.open[epoch] = np.unpackbits(np.frombuffer(raw_bits, np.uint8), count=size).view(bool)
            streams[key] = progress
        return cls(streams)

    @classmethod
    def from_bytes(cls, data: bytes) -> "InputState":
        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"input state of {len(data)} bytes is larger than {MAX_STATE_BYTES}")
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ValueError(f"input state is not valid msgpack ({exc})") from None
        return cls.from_wire(body)
