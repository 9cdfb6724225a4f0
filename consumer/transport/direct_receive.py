"""Direct receive: whole batches read over ZMTP straight into pooled aligned memory.

What ``ZMQInput(receive="direct")`` runs instead of its libzmq receive loop (see ``zmtp``
for why). ``read_batch`` validates as ``decode_batch`` does, but before reading: the header
is decoded and held to the trainer's spec, and each frame's size to its array, so a bad
message costs no allocation and is skipped to its end (the connection stays up); a stream
that cannot be followed any more is dropped and connected again. ``message_steps`` is the same
reading as resumable steps, which a selector loop drives for many connections per thread
(``connection_loop``; plain mode's ``zmtp_receiver``); ``read_message`` drives them with blocking reads.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from stoker.protocol import DecodeLimits, ProtocolError
from stoker.protocol.batch_codec import decode_header
from stoker.protocol.batch_header import MAX_HEADER_BYTES, Batch
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.exact_messages import unpack_producer_frame

from stoker.consumer.transport.zmtp import ZMTPConnection
from stoker.consumer.transport.zmtp_reader import FrameReader, Steps

log = logging.getLogger("stoker.consumer")

MAX_BACKOFF_S = 1.0

EmptyArray = Callable[[np.dtype, tuple[int, ...]], np.ndarray]


def read_batch(conn: ZMTPConnection, spec: BatchSpec, limits: DecodeLimits, empty: EmptyArray) -> tuple[Batch, list[np.ndarray]]:
    """The next message as a Batch whose arrays live in ``empty()`` memory, and its arrays in spec order.

    ProtocolError (or BatchMismatchError) for a bad message, read past when ``conn.in_sync``.
    """
    batch = read_message(conn, spec, limits, empty)
    assert isinstance(batch, Batch)
    return batch, spec.check(batch)


def read_message(conn: ZMTPConnection, spec: Optional[BatchSpec], limits: DecodeLimits, empty: EmptyArray,
                 statuses: bool = False) -> Batch | tuple[dict, int]:
    """The next message: a Batch held to ``spec`` by its header (its arrays in ``empty()`` memory), or with
    ``statuses`` (exact mode) a producer's status (its map and size in bytes). Without a ``spec`` (exact mode before its
    hello) every batch is refused. ProtocolError as ``read_batch``."""
    return conn.drive(message_steps(conn.reader, spec, limits, empty, statuses))


def message_steps(reader: FrameReader, spec: Optional[BatchSpec], limits: DecodeLimits, empty: EmptyArray,
                  statuses: bool = False) -> Steps[Batch | tuple[dict, int]]:
    """``read_message`` as resumable steps (``zmtp_reader``), for a blocking connection or a selector loop."""
    budget = limit = limits.max_message_bytes
    frames = limits.max_arrays  # data frames a message may have after its header
    more, size = yield from reader.next_frame()
    raw = yield from reader.read_small(size, MAX_HEADER_BYTES, "the header frame", more, budget, frames, limit)
    budget -= size
    if statuses and not more:
        status = unpack_producer_frame(raw)
        if status is not None:
            return status, size
    try:
        header = decode_header(raw, limits)
        if spec is None:
            raise ProtocolError(f"producer {header.producer} sent a batch before this trainer asked for one")
        # Held to the spec by the header alone, before any array memory is taken.
        spec.check_declared(header.producer, [(a.name, a.dtype, a.shape) for a in header.arrays])
    except ProtocolError:
        yield from reader.skip(0, more, budget, frames, limit)
        raise
    arrays: dict[str, np.ndarray] = {}
    for i, declared in enumerate(header.arrays):
        if not more:
            raise ProtocolError(f"header lists {len(header.arrays)} arrays but the message has {i} data frames")
        more, size = yield from reader.next_frame()
        frames -= 1
        if size != declared.nbytes:
            yield from reader.skip(size, more, budget, frames, limit)
            raise ProtocolError(f"array {declared.name!r} declares shape {list(declared.shape)} {declared.dtype} = "
                                f"{declared.nbytes} bytes but its frame has {size}")
        array = empty(declared.wire_dtype, declared.shape)
        yield from reader.fill(memoryview(array.reshape(-1).view(np.uint8)))
        budget -= size
        arrays[declared.name] = array
    if more:
        yield from reader.skip(0, more, budget, frames, limit)
        raise ProtocolError(f"header lists {len(header.arrays)} arrays but the message has more data frames")
    return Batch(header=header, arrays=arrays)


def describe(exc: BaseException) -> str:
    """A connection failure for a user: a ProtocolError's own words, else the error's type and message."""
    if isinstance(exc, ProtocolError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
