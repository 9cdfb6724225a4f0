"""Which records of which epochs a trainer's steps have consumed: the input state of exact mode.

``InputState`` maps stream keys (``epochs/stream_key.py``: what one producer serves, and in which epoch order) to
each stream's progress (``epochs/stream_progress.py``): the completed epochs and, for each epoch still open, what
was consumed: a bitmap over the stream's records in epoch order 1, ranges of epoch positions in epoch order 2
(``epochs/position_ranges.py``: an elastic pool consumes splits, so a pool's state costs what is in flight plus
holes, kilobytes at any size). It serialises to a few bytes (msgpack; bitmaps packed and zlib'ed, ranges as varint
deltas zlib'ed): version 1 when every stream is in order 1 (what Stokers before order 2 read), version 2 when a
stream keeps ranges. What a state may expand to is checked before anything is allocated (``MAX_STATE_BITS``,
``MAX_STATE_RANGES``). Nothing is ever unpickled; ``InputState.from_bytes`` validates every field and raises
ValueError naming what is wrong. The names below the key and progress modules are re-exported here, where users and
the rest of Stoker import them.
"""
from __future__ import annotations

import zlib
from functools import lru_cache
from typing import Mapping, Sequence, Union

import msgpack
import numpy as np

from stoker.protocol.epochs.stream_key import (MAX_MATERIALISED_RECORDS, MAX_RECORDS, MAX_WINDOW, ORDER_VERSIONS,
                                               StreamKey, TooManyRecordsError, check_materialisable, epoch_order,
                                               rows_by_epoch)
from stoker.protocol.epochs.stream_progress import RangeProgress, StreamProgress
from stoker.protocol.epochs.position_ranges import PositionRanges


__all__ = ["FORMAT", "VERSION", "InputState", "MAX_MATERIALISED_RECORDS", "MAX_RECORDS", "MAX_STATE_BITS",
           "MAX_STATE_BYTES", "MAX_WINDOW", "ORDER_VERSIONS", "RangeProgress", "StreamKey", "StreamProgress",
           "TooManyRecordsError", "check_materialisable", "epoch_order", "rows_by_epoch"]

FORMAT = "stoker-input-state"
VERSION = 2  #: written when a stream keeps ranges (epoch order 2); states of order 1 alone are still written as 1
READ_VERSIONS = (1, 2)
#: Ranges the open epochs of one state may hold, all streams together (16 bytes each in memory: 64 MiB)
MAX_STATE_RANGES = 1 << 22
MAX_STATE_BYTES = 256 * 1024 * 1024
#: Bits the open epochs of one state may unpack to, all streams together (1 GiB of booleans): a state of today's
#: largest job (10**8 records, two epochs open) is 2e8; a hostile one of 4096 streams could otherwise ask 10**15.
MAX_STATE_BITS = 2**30
Progress = Union[StreamProgress, RangeProgress]  #: a stream's progress: bitmaps (order 1) or ranges (order 2)


def _unpacked_sizes(raw_streams: dict) -> dict:
    """Each stream's size, checked before any bitmap is unpacked: ValueError for a key that is not a stream's,
    open epochs of a dataset too large for bitmaps, or bitmaps that unpack to over ``MAX_STATE_BITS`` together."""
    sizes, bits = {}, 0
    for key, raw in raw_streams.items():
        if not isinstance(key, str):
            raise ValueError(f"input state: stream key {key!r} is not a string")
        stream = StreamKey.parse(key)
        sizes[key], opened = stream.size, raw.get("open") if isinstance(raw, dict) else None
        if isinstance(opened, dict) and opened and stream.order_version == 1:
            stream.check_materialisable()
            bits += stream.size * len(opened)
    if bits > MAX_STATE_BITS:
        raise ValueError(f"input state: its open epochs unpack to {bits:,} bits, over {MAX_STATE_BITS:,}: not a state "
                         "a job saved (one of 10**8 records with two epochs open holds 2e8)")
    return sizes


def _ranges(key: str, epoch: int, packed: bytes, size: int, left: list[int]) -> PositionRanges:
    """An open epoch's consumed positions (epoch order 2), within what is ``left`` of ``MAX_STATE_RANGES``."""
    if left[0] <= 0:
        raise ValueError(f"stream {key} epoch {epoch}: the state holds more than {MAX_STATE_RANGES} ranges")
    try:
        ranges = PositionRanges.from_wire(packed, size, max_ranges=left[0])
    except ValueError as exc:
        raise ValueError(f"stream {key} epoch {epoch}: {exc} (at most {MAX_STATE_RANGES} ranges a state)") from None
    left[0] -= ranges.range_count
    return ranges


@lru_cache(maxsize=256)
def _parse_key(text: str) -> "StreamKey":
    """``StreamKey.parse``, remembered: a step's report names the same few streams every time."""
    return StreamKey.parse(text)


class InputState:
    """A trainer's progress through every stream it reads (see the module doc)."""

    def __init__(self, streams: Mapping[str, Progress] | None = None) -> None:
        self.streams: dict[str, Progress] = dict(streams or {})

    def progress(self, key: str) -> Progress:
        if key not in self.streams:
            stream = _parse_key(key)
            self.streams[key] = (RangeProgress if stream.order_version == 2 else StreamProgress)(stream.size)
        return self.streams[key]

    def mark(self, key: str, epochs: Sequence[int] | np.ndarray, indices: Sequence[int] | np.ndarray) -> None:
        """Record that ``indices`` (of ``epochs``, row by row) were consumed."""
        stream = _parse_key(key)
        progress = self.progress(key)
        epochs, indices = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        for epoch, rows in rows_by_epoch(epochs):
            if stream.order_version == 2:  # kept as epoch positions
                progress.mark(epoch, stream.positions(epoch, indices[rows]))
            else:
                progress.mark(epoch, stream.local(indices[rows]))

    def copy(self) -> "InputState":
        return InputState({k: p.copy() for k, p in self.streams.items()})

    # ---- serialisation -------------------------------------------------------------------

    def to_wire(self) -> dict:
        """Plain msgpack-able form (also what the control channel carries)."""
        streams, version = {}, 1
        for key, progress in self.streams.items():
            if isinstance(progress, RangeProgress):
                version = 2
                opened = {int(e): r.to_wire() for e, r in progress.open.items()}
            else:
                opened = {int(e): zlib.compress(np.packbits(b).tobytes(), 6) for e, b in progress.open.items()}
            streams[key] = {"completed": progress.completed, "open": opened}
        return {"format": FORMAT, "version": version, "streams": streams}

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)

    @classmethod
    def from_wire(cls, body: object) -> "InputState":
        """Validate and load ``to_wire()``'s form; ValueError naming the problem."""
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"not a Stoker input state (format {FORMAT!r} missing)")
        if body.get("version") not in READ_VERSIONS:
            raise ValueError(f"input state version {body.get('version')!r}, this Stoker reads {READ_VERSIONS}")
        raw_streams = body.get("streams")
        if not isinstance(raw_streams, dict) or len(raw_streams) > 4096:
            raise ValueError("input state 'streams' must be a map of at most 4096 streams")
        streams, sizes, ranges_left = {}, _unpacked_sizes(raw_streams), [MAX_STATE_RANGES]
        for key, raw in raw_streams.items():
            size = sizes[key]
            completed, opened = (raw.get("completed"), raw.get("open")) if isinstance(raw, dict) else (None, None)
            if not isinstance(completed, int) or isinstance(completed, bool) or not 0 <= completed < 2**31:
                raise ValueError(f"stream {key}: 'completed' must be an epoch count")
            if not isinstance(opened, dict) or len(opened) > 64:
                raise ValueError(f"stream {key}: 'open' must map at most 64 epochs to bitmaps")
            progress = (RangeProgress if _parse_key(key).order_version == 2 else StreamProgress)(size, completed)
            for epoch, packed in opened.items():
                if not isinstance(epoch, int) or isinstance(epoch, bool) or not completed <= epoch < 2**31:
                    raise ValueError(f"stream {key}: open epoch {epoch!r} is not at or after {completed}")
                if not isinstance(packed, bytes):
                    raise ValueError(f"stream {key} epoch {epoch}: bitmap must be bytes")
                if isinstance(progress, RangeProgress):
                    progress.open[epoch] = _ranges(key, epoch, packed, size, ranges_left)
                    continue
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
