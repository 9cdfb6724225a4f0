"""Direct receive: per producer, a thread reads whole batches over ZMTP straight into pooled aligned memory.

What ``ZMQInput(receive="direct")`` runs instead of its libzmq receive loop (see ``zmtp``
for why). ``read_batch`` validates as ``decode_batch`` does, but before reading: the header
is decoded and held to the trainer's spec, and each frame's size to its array, so a bad
message costs no allocation and is skipped to its end (the connection stays up); a stream
that cannot be followed any more is dropped and connected again. ``DirectReceiver.run``
connects (again every 0.1-1 s while refused), hands each good batch to ``deliver`` and each
bad one to ``reject``, and returns when ``should_stop()`` says so (checked every ``poll_s``)
or when the sink is closed (``SinkClosed``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np

from stoker.protocol import DecodeLimits, ProtocolError
from stoker.protocol.batch_codec import decode_header
from stoker.protocol.batch_header import MAX_HEADER_BYTES, Batch
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.exact_messages import unpack_producer_frame

from stoker.consumer.receive.contract import SinkClosed
from stoker.consumer.transport.zmtp import SocketTypeMismatch, Stopped, ZMTPConnection
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


class DirectReceiver:
    """Receives from one producer address until told to stop; see the module doc."""

    def __init__(self, endpoint: str, spec: BatchSpec, limits: DecodeLimits, empty: EmptyArray,
                 deliver: Callable[[Batch, list[np.ndarray]], None], reject: Callable[[ProtocolError], None],
                 should_stop: Callable[[], bool], on_connection: Callable[..., None],
                 poll_s: float = 0.1) -> None:
        self.endpoint, self.spec, self.limits, self.empty = endpoint, spec, limits, empty
        self.deliver, self.reject, self.should_stop, self.on_connection = deliver, reject, should_stop, on_connection
        self.poll_s = poll_s
        self.delivered = 0  # batches handed to ``deliver``

    def run(self) -> None:
        """Receive until stopped or the sink closes. Connection and protocol trouble is reported, never raised.

        Reconnects wait ``poll_s``, doubling up to ``MAX_BACKOFF_S`` while connections fail or end
        without delivering a batch (a peer that accepts and resets costs one attempt a second, not a
        busy loop); a connection that delivered resets the wait.
        """
        backoff = self.poll_s
        while not self.should_stop():
            try:
                conn = ZMTPConnection(self.endpoint, self.should_stop, self.poll_s)
            except Stopped:
                return
            except (OSError, ProtocolError) as exc:  # refused, unreachable, not a producer: try again
                self.on_connection(self.endpoint, False, _describe(exc), isinstance(exc, ProtocolError),
                                   mode_mismatch=isinstance(exc, SocketTypeMismatch))
                if self._sleep(backoff):
                    return
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            self.on_connection(self.endpoint, True, "", False)
            delivered_before = self.delivered
            try:
                self._receive(conn)
                return
            except Stopped:
                return
            except SinkClosed:
                return  # the sink was closed: close() or a failure
            except (OSError, ProtocolError) as exc:  # the peer went away, or its stream cannot be followed
                self.on_connection(self.endpoint, False, _describe(exc), False)
            finally:
                conn.close()
            backoff = self.poll_s if self.delivered > delivered_before else min(MAX_BACKOFF_S, backoff * 2)
            if self._sleep(backoff):
                return

    def _receive(self, conn: ZMTPConnection) -> None:
        while not self.should_stop():
            try:
                batch, arrays = read_batch(conn, self.spec, self.limits, self.empty)
            except ProtocolError as exc:
                self.reject(exc)
                if not conn.in_sync:
                    raise
                continue
            self.deliver(batch, arrays)
            self.delivered += 1

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` in ``poll_s`` steps; True if told to stop meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.should_stop():
                return True
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        return self.should_stop()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ProtocolError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
