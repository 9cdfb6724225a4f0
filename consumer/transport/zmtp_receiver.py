"""Plain mode over our own ZMTP: a ``DirectReceiver`` thread per producer, reading into the sink's memory.

The default for tcp:// without CurveZMQ. Each thread reads whole batches straight into
aligned buffers (no copy beyond the kernel's) and bounds every message before reading it:
memory is one batch per producer, whatever a peer sends (``direct_receive``, docs/security.md).
Without a declared spec the first batch header that arrives defines it (``LearnedSpec``) and
every producer is held to it, as on the libzmq path. The core's thread runs ``run``: it only
watches for silence while the per-producer threads receive.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Optional, Sequence

from stoker.protocol import ProtocolError
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import ArrayShape, BatchSpec

from stoker.consumer.receive.errors import InputError
from stoker.consumer.receive.contract import POLL_S, ReceiveContext
from stoker.consumer.transport.connections import ConnectionHealth
from stoker.consumer.transport.direct_receive import DirectReceiver
from stoker.consumer.receive.options import tcp_address
from stoker.consumer.transport.discovery import ProducerPool

if TYPE_CHECKING:
    from stoker.consumer.receive.options import ReceiveOptions

log = logging.getLogger("stoker.consumer")

_DROP_LOG_EVERY_S = 10.0


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


class ZMTPReceiver:
    """See the module doc. ValueError for an address that is not tcp://host:port."""

    held_per_producer = 1  # the batch its thread reads into, or holds while waiting for room

    def __init__(self, pool: ProducerPool, options: "ReceiveOptions") -> None:
        self.pool = pool
        for address in pool.endpoints:
            tcp_address(address)
        self.limits = options.limits
        self._spec: Optional[BatchSpec | LearnedSpec] = None
        self._threads: list[threading.Thread] = []
        self._leave: dict[str, threading.Event] = {}  # endpoint -> set when it left the pool
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
        for address in self.pool.endpoints:
            self._join_one(address, context)

    def _join_one(self, address: str, context: ReceiveContext) -> None:
        """A receive thread for one producer, stopped when the input stops or the producer leaves the pool."""
        assert self._spec is not None
        try:
            tcp_address(address)
        except ValueError as exc:  # a discovery function returned something direct receive cannot reach
            context.stats.connection_changed(address, False, str(exc), False)
            return
        leave = self._leave[address] = threading.Event()
        receiver = DirectReceiver(address, self._spec, self.limits, context.empty,  # type: ignore[arg-type]
                                  lambda batch, arrays: context.deliver(batch, arrays, owned=True), context.reject,
                                  lambda: context.stopped() or leave.is_set(), self._connection_callback(context),
                                  poll_s=POLL_S)
        thread = threading.Thread(target=self._run_one, args=(receiver, context), name=f"stoker-receive-{address}",
                                  daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _follow_pool(self, context: ReceiveContext) -> None:
        def join(address: str) -> None:
            if self._started:  # else _start connects to every endpoint the pool has then
                self._join_one(address, context)

        context.follow_pool(join, self._leave_one)

    def _leave_one(self, address: str) -> None:
        leave = self._leave.pop(address, None)
        if leave is not None:
            leave.set()  # its thread drops the batch it may be reading and closes the connection

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

    @staticmethod
    def _run_one(receiver: DirectReceiver, context: ReceiveContext) -> None:
        try:
            receiver.run()
        except Exception as exc:  # never die silently: surface it to the consumer
            log.exception("receive thread for %s failed", receiver.endpoint)
            context.fail(InputError(f"receive thread for {receiver.endpoint} failed: {exc!r}"))

    def run(self, context: ReceiveContext) -> None:
        self._start(context)
        try:
            while context.watch():
                self._follow_pool(context)
                context.wait(POLL_S)
        finally:
            self._join()

    def _join(self) -> None:
        deadline = time.monotonic() + 1.5  # readers notice a stop within POLL_S; close() waits 2 s for the core
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        lingering = [t.name for t in self._threads if t.is_alive()]
        if lingering:
            log.warning("direct receive threads still running after the stop: %s", ", ".join(lingering))
        self._threads = [t for t in self._threads if t.is_alive()]

    def failures(self) -> tuple[int, str, str]:
        return self._health.summary()

    def mode_mismatches(self) -> dict[str, int]:
        return self._health.mismatches()

    def waiting_report(self) -> list[str]:
        return []

    def close(self) -> None:
        self._join()  # the core stopped: each thread closes its own connection on its way out
