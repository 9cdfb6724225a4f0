"""The contracts around the receive core: what a receiver may call, what a sink must take.

    Receiver (libzmq PULL | direct ZMTP | exact DEALERs) --ReceiveContext--> ReceiveCore --BatchSink--> sink

A ``Receiver`` (one per transport, in ``transport/`` and ``exact/``) sees the core only through
``ReceiveContext``: these members and no others, so a receiver is tested and replaced without the
rest of the core. A ``BatchSink`` is where batches go (the TensorFlow feeder, ``BatchStream``'s queue,
any framework's). Nothing here imports a framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import numpy as np

from stoker.protocol import ProtocolError
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import BatchSpec

if TYPE_CHECKING:
    from stoker.consumer.receive.errors import InputError
    from stoker.consumer.transport.discovery import ProducerPool

ALIGN = 64
#: the longest any receive loop blocks before it checks for a stop, the pool and silence
POLL_S = 0.1


class SinkClosed(Exception):
    """The sink was closed (the input is stopping or failed): the receiver stops delivering."""


def aligned_empty(dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """A fresh C-contiguous array whose data starts on a 64-byte boundary (what TensorFlow and SIMD want)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


class BatchSink(Protocol):
    """Where validated batches go. ``put`` may block while full; every method is thread-safe."""

    capacity: int

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Memory a receiver reads a batch array into, then hands over with ``put(..., owned=True)``."""

    def put(self, arrays: Sequence[np.ndarray], owned: bool) -> None:
        """Take one batch (arrays in spec order; ``owned``: from ``empty``, else copied). SinkClosed once closed."""

    def size(self) -> int:
        """Batches waiting for the consumer."""

    def end(self) -> None:
        """No batch will follow (a finite exact run finished): the consumer drains what is there, then ends."""

    def close(self, cancel: bool) -> None:
        """No more puts; ``cancel`` also wakes a blocked ``put`` (it raises SinkClosed)."""


class ConnectionReports(Protocol):
    """What receivers report about their connections and control traffic (``ReceiveStats`` implements it)."""

    def set_connections(self, connected: set[str], failures: int, reason: str, reconnects: int) -> None:
        """The whole picture from socket monitors: connected endpoints, failed handshakes, re-connects."""

    def connection_changed(self, endpoint: str, connected: bool, reason: str, handshake_failed: bool,
                           drops: int = 1) -> bool:
        """One endpoint's news; True if it was connected before (a lost connection)."""

    def set_control(self, sent: int, bytes_sent: int, received: int, bytes_received: int,
                    liveness_sent: int = 0, liveness_received: int = 0) -> None:
        """Exact mode's control messages so far (totals); of their bytes, liveness's (heartbeats, statuses)."""

    def set_pool_work(self, reserved: int, backed_up: int, wasted: int, stuck: int, stall_warnings: int) -> None:
        """Exact mode's liveness counters so far (totals)."""


class ReceiveContext(Protocol):
    """The core as a receiver sees it: the whole contract between the two (``ReceiveCore`` implements it)."""

    #: the spec every batch is held to (resolved before ``run``)
    spec: BatchSpec
    #: where connection news and control counts go
    stats: ConnectionReports

    def learn_spec(self, turn: Callable[[], Optional[BatchSpec]], how: str) -> BatchSpec:
        """Call ``turn`` (one bounded poll, None until a spec is known) until it gives the spec; raises the
        input's error once waiting is hopeless (timeout, mode mismatch). ``how`` ends the timeout message."""

    def follow_pool(self, join: Callable[[str], object], leave: Callable[[str], object]) -> bool:
        """Apply the producer pool's changes, when due; whether it changed."""

    def watch(self) -> bool:
        """Fail a silent or mismatched input; False once the receiver must stop. Call at least every POLL_S."""

    def stopped(self) -> bool:
        """The input is stopping or failed."""

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if the input is stopping."""

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Memory the sink will own, for a batch array to be read into."""

    def deliver(self, batch: Batch, arrays: Sequence[np.ndarray], owned: bool) -> None:
        """A good batch into the sink (may block for room). SinkClosed once closing."""

    def deliver_now(self, batch: Batch, arrays: Sequence[np.ndarray], owned: bool) -> bool:
        """``deliver`` if the sink has room this moment, on the caller's thread; False (nothing done) if it would
        wait, or the sink cannot tell. SinkClosed once closing."""

    def reject(self, exc: ProtocolError) -> None:
        """A bad message: counted and logged (rate-limited)."""

    def alive(self) -> None:
        """The producers are alive, or the step is not waiting for data: this is not silence."""

    def fill(self) -> tuple[int, int]:
        """``(batches queued, room for more)`` in the sink."""

    def fail(self, error: "InputError") -> None:
        """Fail the input (the first error wins)."""

    def finish(self) -> None:
        """Every producer finished its epochs: the sink ends after what it holds."""


class Receiver(Protocol):
    """One transport's receiving end. Runs on the core's thread unless it says otherwise."""

    #: the producers it connects to; it follows their changes with ``context.follow_pool`` every POLL_S
    pool: "ProducerPool"
    #: what the per-producer memory bound counts: batches one producer's connection may hold
    held_per_producer: int

    def resolve_spec(self, declared: Optional[BatchSpec], context: ReceiveContext) -> BatchSpec:
        """The spec batches are held to: ``declared``, or learned/described through ``context.learn_spec``."""

    def run(self, context: ReceiveContext) -> None:
        """Receive and deliver until ``context.watch()`` returns False or the sink closes."""

    def failures(self) -> tuple[int, str, str]:
        """Failed handshakes so far: ``(count, last endpoint, why)``."""

    def mode_mismatches(self) -> dict[str, int]:
        """Per endpoint, handshakes refused in a row because one side runs exact mode and the other not."""

    def waiting_report(self) -> list[str]:
        """What the receiver itself waits for, a line each (exact mode: sessions, held work); may be empty."""

    def close(self) -> None:
        """Close every socket (called by the last thread that may be inside one)."""
