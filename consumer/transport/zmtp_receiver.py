"""Plain mode over our own ZMTP: every producer's connection on a bounded loop of threads, read into the sink's memory.

The default for tcp:// and ipc:// without CurveZMQ. A ``ConnectionLoop`` (at most ``MAX_THREADS`` threads,
however many producers) drives one ``LoopConnection`` per producer, whose ``PlainPeer`` reads whole batches
straight into aligned buffers (no copy beyond the kernel's) and bounds every message before reading it:
memory is one batch per producer, whatever a peer sends (``direct_receive``, docs/security.md). A batch
completed goes into the sink on the loop's thread when the sink has room that moment (``deliver_now``: no
other thread woken); else it is handed to a delivery thread (``_Deliveries``), which waits while the sink is
full, and its connection reads nothing more until it is delivered, so a full sink holds producers back
through TCP while the loop goes on answering handshakes and heartbeats. Receive threads: ``MAX_THREADS`` at most.
Without a declared spec the first batch header that arrives defines it (``LearnedSpec``) and
every producer is held to it, as on the libzmq path. The core's thread runs ``run``: it only
watches for silence while the loop receives.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from stoker.protocol import DecodeLimits, ProtocolError
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import ArrayShape, BatchSpec

from stoker.consumer.receive.errors import InputError
from stoker.consumer.receive.contract import POLL_S, ReceiveContext, SinkClosed
from stoker.consumer.transport.connections import ConnectionHealth
from stoker.consumer.transport.connection_loop import MAX_THREADS, ConnectionLoop, reserve_descriptors
from stoker.consumer.transport.direct_receive import EmptyArray, describe, message_steps
from stoker.consumer.transport.loop_connection import LoopConnection
from stoker.consumer.transport.zmtp import SocketTypeMismatch
from stoker.consumer.transport.zmtp_reader import FrameReader, Steps
from stoker.consumer.receive.stream_address import stream_address
from stoker.consumer.transport.discovery import ProducerPool

if TYPE_CHECKING:
    from stoker.consumer.receive.options import ReceiveOptions

log = logging.getLogger("stoker.consumer")

_DROP_LOG_EVERY_S = 10.0
#: Threads handing batches to the sink (the rest of ``MAX_THREADS`` read): one made a sink's put the bottleneck at
#: 4 producers (trainer_ingest: 0.78 of a thread per producer's rate).
DELIVERY_THREADS = 3


class LearnedSpec:
    """A ``BatchSpec`` stand-in for ``read_batch``: the first header checked defines the spec (thread-safe)."""

    def __init__(self) -> None:
        self.spec: Optional[BatchSpec] = None
        self.learned = threading.Event()
        self._lock = threading.Lock()

    def check_declared(self, producer: str, declared: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        with self._lock:
            if self.spec is None:
                try:
                    self.spec = BatchSpec(tuple(ArrayShape(n, d, tuple(s)) for n, d, s in declared))
                except ValueError as exc:  # not a batch (sizes disagree, a scalar): nothing to learn from
                    raise ProtocolError(f"producer {producer} sends arrays that are not a batch: {exc}") from None
                log.info("learned the batch spec from producer %s: %s", producer, self.spec)
                self.learned.set()
        self.spec.check_declared(producer, declared)

    def check(self, batch: Batch) -> list:
        assert self.spec is not None
        return self.spec.check(batch)


class PlainPeer:
    """One plain producer's connection for the loop (``loop_connection.Peer``): each batch held to the spec and
    delivered into the sink, a bad one rejected, connection news to ``on_connection``."""

    socket_type = "PULL"

    def __init__(self, endpoint: str, spec: "BatchSpec | LearnedSpec", limits: DecodeLimits, context: ReceiveContext,
                 leave: threading.Event, on_connection: Callable[..., None], deliveries: "_Deliveries") -> None:
        self.endpoint, self._spec, self._limits, self._context = endpoint, spec, limits, context
        self._leave, self._on_connection = leave, on_connection
        self._empty: EmptyArray = context.empty
        self._deliveries = deliveries
        self._delivering: Optional[LoopConnection] = None  # while a batch of it waits for the delivery thread
        self._connection: Optional[LoopConnection] = None

    def leaving(self) -> bool:
        return self._context.stopped() or self._leave.is_set()

    def has_room(self) -> bool:
        return self._delivering is None  # one batch per producer, read or waiting for the sink, as before

    def message_steps(self, reader: FrameReader) -> Steps[tuple[Batch, list]]:
        batch = yield from message_steps(reader, self._spec, self._limits, self._empty)  # type: ignore[arg-type]
        assert isinstance(batch, Batch)
        return batch, self._spec.check(batch)  # BatchMismatchError: rejected as a bad message, the stream goes on

    def connected(self, connection: LoopConnection) -> None:
        self._connection = connection
        self._on_connection(self.endpoint, True, "", False)

    def refused(self, exc: Exception) -> None:
        self._on_connection(self.endpoint, False, describe(exc), isinstance(exc, ProtocolError),
                            mode_mismatch=isinstance(exc, SocketTypeMismatch))

    def ended(self, exc: Exception, delivered: bool) -> None:
        self._on_connection(self.endpoint, False, describe(exc), False)

    def message(self, message: tuple[Batch, list]) -> None:
        batch, arrays = message
        if self._context.deliver_now(batch, arrays, owned=True):
            return  # the sink had room: handed over on this thread, and the connection reads on
        self._delivering = self._connection  # else a delivery thread waits for room, and this peer for it
        self._deliveries.put((self, message))

    def delivered(self) -> None:
        """The delivery thread handed this peer's batch to the sink: read on."""
        connection, self._delivering = self._delivering, None
        if connection is not None:
            connection.wake()

    def rejected(self, exc: ProtocolError, in_sync: bool) -> None:
        self._context.reject(exc)

    def closed(self) -> None:
        pass


class _Deliveries(threading.Thread):
    """One of the ``DELIVERY_THREADS`` threads that hand finished batches to the sink, waiting while it is full (a
    sink's put, TensorFlow's enqueue, runs a while: several of them keep several producers' batches going in, as a
    thread per producer did); ends when the input stops or the sink closes."""

    def __init__(self, context: ReceiveContext, batches: "queue.SimpleQueue[tuple[PlainPeer, tuple[Batch, list]]]",
                 number: int) -> None:
        super().__init__(name=f"stoker-receive-deliver-{number}", daemon=True)
        self._context = context
        self._queue = batches
        self.put = self._queue.put

    def run(self) -> None:
        while not self._context.stopped():
            try:
                peer, (batch, arrays) = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                self._context.deliver(batch, arrays, owned=True)
            except SinkClosed:
                return
            except Exception as exc:  # never die silently: surface it to the consumer
                log.exception("delivering a batch of %s failed", peer.endpoint)
                self._context.fail(InputError(f"delivering a batch of {peer.endpoint} failed: {exc!r}"))
                return
            peer.delivered()


class ZMTPReceiver:
    """See the module doc. ValueError for an address that is neither tcp://host:port nor ipc://PATH."""

    held_per_producer = 1  # the batch its connection reads into, or holds while waiting for room

    def __init__(self, pool: ProducerPool, options: "ReceiveOptions") -> None:
        self.pool = pool
        for address in pool.endpoints:
            stream_address(address)
        self.limits = options.limits
        self._spec: Optional[BatchSpec | LearnedSpec] = None
        self._loop: Optional[ConnectionLoop] = None
        self._deliveries: Optional[_Deliveries] = None
        self._delivery_threads: list[_Deliveries] = []
        self._leave: dict[str, threading.Event] = {}  # endpoint -> set when it left the pool
        self._wakes: dict[str, Callable[[], None]] = {}  # endpoint -> its connection's wake
        self._started = False
        self._lock = threading.Lock()
        self._health = ConnectionHealth()
        self._drop_logged_at: dict[str, float] = {}
        self._unlogged_drops: dict[str, int] = {}

    def resolve_spec(self, declared: Optional[BatchSpec], context: ReceiveContext) -> BatchSpec:
        if declared is not None:
            self._spec = declared
            return declared
        learner = self._spec = LearnedSpec()
        self._start(context)

        def turn() -> Optional[BatchSpec]:
            if learner.learned.wait(POLL_S):
                return learner.spec
            self._follow_pool(context)
            return None
        return context.learn_spec(turn, "waited for a first batch to learn it from")

    def _start(self, context: ReceiveContext) -> None:
        if self._started:
            return
        self._started = True
        reserve_descriptors(len(self.pool.endpoints))
        batches: queue.SimpleQueue = queue.SimpleQueue()
        deliveries = min(DELIVERY_THREADS, max(1, len(self.pool.endpoints)))
        self._delivery_threads = [_Deliveries(context, batches, n) for n in range(deliveries)]
        self._deliveries = self._delivery_threads[0]
        for thread in self._delivery_threads:
            thread.start()
        self._loop = ConnectionLoop("stoker-receive", POLL_S, lambda endpoint, exc: context.fail(
            InputError(f"receiving from {endpoint} failed: {exc!r}")), max_threads=MAX_THREADS - DELIVERY_THREADS)
        for address in self.pool.endpoints:
            self._join_one(address, context)

    def _join_one(self, address: str, context: ReceiveContext) -> None:
        """A receive thread for one producer, stopped when the input stops or the producer leaves the pool."""
        assert self._spec is not None
        try:
            stream_address(address)
        except ValueError as exc:  # a discovery function returned something direct receive cannot reach
            context.stats.connection_changed(address, False, str(exc), False)
            return
        reserve_descriptors(len(self._leave) + 1)
        leave = self._leave[address] = threading.Event()
        assert self._deliveries is not None
        peer = PlainPeer(address, self._spec, self.limits, context, leave, self._connection_callback(context),
                         self._deliveries)
        assert self._loop is not None
        connection = LoopConnection(peer, POLL_S)
        self._loop.add(connection)
        self._wakes[address] = connection.wake  # set by the loop: a leaving peer is closed on its next turn

    def _follow_pool(self, context: ReceiveContext) -> None:
        def join(address: str) -> None:
            if self._started:  # else _start connects to every endpoint the pool has then
                self._join_one(address, context)

        context.follow_pool(join, self._leave_one)

    def _leave_one(self, address: str) -> None:
        leave = self._leave.pop(address, None)
        if leave is not None:
            leave.set()  # its thread drops the batch it may be reading and closes the connection
            self._wakes.pop(address, lambda: None)()  # now: the loop has no sweep over every connection to notice it

    def _connection_callback(self, context: ReceiveContext):  # type: ignore[no-untyped-def]
        def on_connection(endpoint: str, connected: bool, reason: str, handshake_failed: bool,
                          mode_mismatch: bool = False, drops: int = 1) -> None:
            if handshake_failed:
                self._health.failed(endpoint, reason, mode_mismatch)
            elif connected:
                self._health.succeeded(endpoint)
            if endpoint not in self._leave:
                return  # news from a producer that left the pool
            if context.stats.connection_changed(endpoint, connected, reason, handshake_failed, drops) and not connected:
                self._log_drop(endpoint, reason)
        return on_connection

    def _log_drop(self, endpoint: str, reason: str) -> None:
        """The first lost connection per producer, then one line per ``_DROP_LOG_EVERY_S`` with the count."""
        now = time.monotonic()
        with self._lock:
            self._unlogged_drops[endpoint] = self._unlogged_drops.get(endpoint, 0) + 1
            if now - self._drop_logged_at.get(endpoint, -_DROP_LOG_EVERY_S) < _DROP_LOG_EVERY_S:
                return
            count, self._unlogged_drops[endpoint], self._drop_logged_at[endpoint] = \
                self._unlogged_drops[endpoint], 0, now
        log.warning("lost the connection to %s (%d time(s) since the last warning): %s", endpoint, count, reason)

    def run(self, context: ReceiveContext) -> None:
        self._start(context)
        try:
            while context.watch():
                self._follow_pool(context)
                context.wait(POLL_S)
        finally:
            self._join()

    def _join(self) -> None:
        if self._loop is not None:  # its threads notice the stop within POLL_S; close() waits 2 s for the core
            self._loop.close(1.0)
        for thread in self._delivery_threads:
            thread.join(0.5)

    def failures(self) -> tuple[int, str, str]:
        return self._health.summary()

    def mode_mismatches(self) -> dict[str, int]:
        return self._health.mismatches()

    def waiting_report(self) -> list[str]:
        return []

    def close(self) -> None:
        self._join()  # the core stopped: the loop's threads close their connections on their way out
