"""The receive core under every trainer input: a transport receiver feeding a sink, watched for silence.

    Receiver (libzmq PULL | direct ZMTP | exact DEALERs) --deliver--> ReceiveCore --put--> BatchSink
                                                                       (TF feeder, NumPy stream)

A *receiver* owns its sockets, connects to the producer addresses, validates every message
and calls ``deliver`` with whole batches held to the spec; bad messages go to ``reject``
(counted, logged rate-limited). It sees the core only as a ``ReceiveContext``
(``contract.py``). A *sink* takes the arrays: the TensorFlow feeder (``tf.feeder``), the
plain-Python ``BatchStream``, or any ``BatchSink``. The core in between knows neither
sockets nor frameworks: it resolves the batch spec (declared, learned from the first batch,
or described by exact-mode producers), runs the receiver on one thread, and fails the input
with one error that says why when no acceptable batch arrived for ``recv_timeout`` seconds,
or at once when every producer refused the handshake because one side runs exact mode and
the other does not (a mismatch that waiting cannot fix), and when, before any batch was accepted, every
producer sent ``MISMATCH_BATCHES`` batches that can never match the spec (later ones are only counted).
A few seconds in it warns once about addresses it cannot reach (``UNREACHABLE_WARN_S``). When nothing was delivered for
``stall_after`` seconds while the sink had room (the step waits for data), it logs once what it
waits for: the pool, each producer's connection and last batch, and the receiver's own
``waiting_report()`` (exact mode: sessions, held work, open epochs). ``close()`` is bounded (about 2 s).
No TensorFlow is imported here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from stoker.protocol import ProtocolError
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import BatchSpec

from stoker.consumer.sizing.pool_sizing import PoolSizer
from stoker.consumer.receive.errors import InputClosedError, InputError, InputTimeoutError
from stoker.consumer.receive.diagnosis import InputDiagnosis
from stoker.consumer.receive.contract import POLL_S, BatchSink, Receiver, SinkClosed, aligned_empty
from stoker.consumer.receive.stats import ReceiveStats

if TYPE_CHECKING:
    from stoker.consumer.receive.options import ReceiveOptions

log = logging.getLogger("stoker.consumer")

SAMPLE_EVERY_S = 0.05
#: The pool-size estimate is updated every this many samples (about once a second).
SIZING_EVERY_SAMPLES = 20
#: Refused handshakes per producer, all for a mode mismatch, after which waiting longer cannot help.
MISMATCH_REFUSALS = 3
#: Batches that can never match the spec, from each producer of the pool and before any acceptable batch, after
#: which waiting longer cannot help (a producer's batches do not change while it runs).
MISMATCH_BATCHES = 3
#: After this long (a quarter of ``recv_timeout`` if shorter), warn once about producers that cannot be reached.
UNREACHABLE_WARN_S = 3.0


class ReceiveCore:
    """Runs ``receiver`` into a sink; see the module doc. Implements ``ReceiveContext`` for the receiver.

    ``options.spec`` (declared, or None to learn it) is resolved in the constructor, which may wait up to
    ``recv_timeout`` for producers. ``start(sink)`` begins delivering; ``error`` says why the input
    failed (also after ``close()``: InputClosedError); ``finished`` is set when a finite run ended.
    """

    def __init__(self, receiver: Receiver, options: "ReceiveOptions") -> None:
        self.receiver = receiver
        self.options = options
        self.pool = receiver.pool
        self.sources = receiver.pool.describe()  # the addresses or names the user gave, for messages
        self.recv_timeout = options.recv_timeout
        self.stall_after = options.stall_after
        self.stall_reports = 0
        self._delivered_at = time.monotonic()
        self._stall_reported = False
        self.stats = ReceiveStats()
        self.diagnosis = InputDiagnosis(receiver, self.stats, options.recv_timeout)
        self.stats.pool_changed([], [], len(self.pool.endpoints))
        self.error: Optional[InputError] = None
        self.finished = False
        self._stop = threading.Event()
        self._sink: Optional[BatchSink] = None
        self._sink_ready = threading.Event()
        self._lock = threading.Lock()
        self._delivering = 0
        self._last_batch_at = time.monotonic()
        self._handshake_failures_at_batch = 0
        self._thread: Optional[threading.Thread] = None
        self._sampler: Optional[threading.Thread] = None
        # Sockets are closed by whoever last may use them: close() once the receive thread has ended, else
        # that thread on its way out (closing a socket another thread is inside aborts libzmq).
        self._socket_owner = threading.Lock()
        self._receiver_ended = True
        self._abandoned = False
        self._closed_sockets = False
        self._started_at = time.monotonic()
        self._unreachable_warned = False
        try:
            self.spec = receiver.resolve_spec(options.spec, self)
        except BaseException:
            self._stop.set()
            self._close_receiver()
            raise
        #: how many producers this input needs (``consumer/sizing``): fed per batch and by the sampler
        self.sizer = PoolSizer(max(1, self.spec.batch_size))

    # ---- ReceiveContext: what the receivers call ---------------------------------------------------

    def learn_spec(self, turn: Callable[[], Optional[BatchSpec]], how: str) -> BatchSpec:
        started = time.monotonic()
        while True:
            spec = turn()
            if spec is not None:
                return spec
            failure = self.failure(time.monotonic() - started, f"; no batch spec was given, so the trainer {how}")
            if failure is not None:
                raise failure
            self._warn_unreachable()

    def follow_pool(self, join: Callable[[str], object], leave: Callable[[str], object]) -> bool:
        """Re-resolve the producer pool when due and apply the change: ``leave(endpoint)`` for each producer
        that left, then ``join(endpoint)`` for each that joined; a ValueError from ``join`` (an address the
        receiver cannot reach) is counted as that endpoint's connection error. Whether the pool changed."""
        joined, left = self.pool.refresh()
        if not joined and not left:
            return False
        self.stats.pool_changed(joined, left, len(self.pool.endpoints))
        for endpoint in left:
            leave(endpoint)
        for endpoint in joined:
            try:
                join(endpoint)
            except ValueError as exc:
                self.stats.connection_changed(endpoint, False, f"cannot connect: {exc}", False)
        return True

    def stopped(self) -> bool:
        return self._stop.is_set() or self.error is not None

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if the input is stopping."""
        return self._stop.wait(seconds)

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        sink = self._sink
        return sink.empty(dtype, shape) if sink is not None else aligned_empty(dtype, shape)

    def deliver(self, batch: Batch, arrays: Sequence[np.ndarray], owned: bool) -> None:
        """A good batch into the sink (waits for it to exist, and for room). SinkClosed once closing."""
        while not self._sink_ready.wait(POLL_S):
            if self.stopped():
                raise SinkClosed()
        assert self._sink is not None
        # Counted before the put: what the stats say must never lag a batch the consumer took (a test saw 62 of 64).
        conflict = self._count(batch, arrays)
        with self._lock:
            self._delivering += 1
        try:
            self._sink.put(arrays, owned)
        finally:
            with self._lock:
                self._delivering -= 1
        self._delivered(conflict)

    def deliver_now(self, batch: Batch, arrays: Sequence[np.ndarray], owned: bool) -> bool:
        """``deliver`` on the caller's thread if the sink exists and has room now (a receive loop then hands its
        batch over without a delivery thread's wake-ups); False, nothing done, otherwise. SinkClosed once closing."""
        put_now = getattr(self._sink, "put_now", None)  # a framework's sink (TensorFlow's queue) may only block
        conflicts: list[Optional[str]] = []
        if owned and put_now is not None and self._sink_ready.is_set() and \
                put_now(arrays, owned, lambda: conflicts.append(self._count(batch, arrays))):
            self._delivered(conflicts[0])
        return bool(conflicts)

    def _count(self, batch: Batch, arrays: Sequence[np.ndarray]) -> Optional[str]:
        """A batch about to enter the sink, in the stats and the sizing's supply; the shard conflict it reveals."""
        self.sizer.supply.batch(batch.header.producer, batch.header.worker, len(arrays[0]) if arrays else 0,
                                batch.header.stages)
        return self.stats.accepted(batch, arrays)

    def _delivered(self, conflict: Optional[str]) -> None:
        self._handshake_failures_at_batch = self.receiver.failures()[0]
        self._last_batch_at = self._delivered_at = time.monotonic()
        self._stall_reported = False
        if conflict and self.options.exact:
            self.fail(InputError(f"exact mode cannot hold every record once per epoch: {conflict}"))

    def reject(self, exc: ProtocolError) -> None:
        self.stats.rejected(exc)

    def alive(self) -> None:
        """The producers are alive, or the step is not waiting for data: this is not silence."""
        self._last_batch_at = time.monotonic()

    def fill(self) -> tuple[int, int]:
        """``(batches queued, room for more)`` in the sink, from one size query (``(0, 0)`` before it exists)."""
        sink = self._sink
        if sink is None:
            return 0, 0
        size = sink.size()  # a TensorFlow op: asked once per turn of a receive loop, not per question
        return size, sink.capacity - size

    def watch(self) -> bool:
        """Called by the receiver at least every ``POLL_S``: fails a silent or mismatched input; False to stop."""
        if self.stopped():
            return False
        with self._lock:
            if self._delivering:  # waiting for room in a full queue is not silence from the producers
                self._last_batch_at = time.monotonic()
        failure = self.failure(time.monotonic() - self._last_batch_at)
        if failure is not None:
            self.fail(failure)
            return False
        self._warn_unreachable()
        self._report_stall()
        return True

    def _warn_unreachable(self) -> None:
        """Once, ``UNREACHABLE_WARN_S`` after the start: name each producer address that cannot be reached and why
        (refused, a name with no address behind it), well before ``recv_timeout`` ends the wait."""
        waited = time.monotonic() - self._started_at
        if self._unreachable_warned or waited < min(UNREACHABLE_WARN_S, self.recv_timeout / 4):
            return
        self._unreachable_warned = True  # judged once; later silence is the stall report's
        causes = self.diagnosis.unreachable()
        if causes:
            log.warning("cannot reach producers after %.0f s (still trying until recv_timeout=%gs): %s; check that "
                        "`stoker produce` runs at each address and that this host can reach it", waited,
                        self.recv_timeout, "; ".join(causes))

    def _report_stall(self) -> None:
        """Log once, after ``stall_after`` s without a delivery while the step waits, what the input waits for."""
        silent = time.monotonic() - self._delivered_at
        if self._stall_reported or self.stall_after is None or silent <= self.stall_after or self._delivering:
            return
        sink = self._sink
        if sink is None or sink.size() >= sink.capacity:
            return  # a full queue: the step is slow, the input is not
        self._stall_reported = True
        self.stall_reports += 1
        log.warning("the input delivered nothing for %.0f s while the step waits for data:\n  %s", silent,
                    "\n  ".join(self.waiting_for()))

    def waiting_for(self) -> list[str]:
        """What the input waits for, a line each (``InputDiagnosis.waiting_for``)."""
        return self.diagnosis.waiting_for()

    def failure(self, silent: float, waiting_for: str = "") -> Optional[InputError]:
        """The error to fail with now, if any: every producer refused the handshake for a mode mismatch, or sent
        only batches that can never match the spec (``MISMATCH_BATCHES`` each), or ``silent`` past ``recv_timeout``."""
        failure = self.diagnosis.mode_refused(MISMATCH_REFUSALS) or self.diagnosis.certain_mismatch(
            MISMATCH_BATCHES)
        if failure is not None:
            return failure
        if silent > self.recv_timeout:
            return InputTimeoutError(self.diagnosis.timeout_message(silent, self._handshake_failures_at_batch)
                                     + waiting_for)
        return None

    def finish(self, skipped: int = 0) -> None:
        """Every producer finished its epochs: the sink ends after what it holds. ``skipped``: records the producers
        skipped for bad data (exact mode: the epochs completed without them), said here, where the trainer looks."""
        self.finished = True
        if skipped:
            log.warning("every producer finished its epochs: the input ends after the last batch; %d record(s) "
                        "skipped by producers (bad data: unreadable, undecodable or killing a worker; each producer's "
                        "log names them), so the epochs completed without them", skipped)
        else:
            log.info("every producer finished its epochs: the input ends after the last batch")
        if self._sink is not None:
            self._sink.end()

    def fail(self, error: InputError) -> None:
        """Fail the input once (the first error wins); the consumer drains what is queued, then sees it."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
        if not isinstance(error, InputClosedError):
            log.error("%s", error)
        if self._sink is not None:
            try:
                self._sink.close(cancel=False)
            except Exception:  # its framework may have shut down first (a closed tf.compat.v1 Session)
                pass

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, sink: BatchSink) -> None:
        """Deliver into ``sink`` from now on (on a thread of the core's). Idempotent."""
        if self._thread is not None:
            return
        self._sink = sink
        self._last_batch_at = self._delivered_at = time.monotonic()
        self._receiver_ended = False
        self._thread = threading.Thread(target=self._run, name="stoker-receive", daemon=True)
        self._thread.start()
        self._sink_ready.set()
        # Occupancy is sampled by time, not per put: a queue that sits full while puts block still counts as full.
        self._sampler = threading.Thread(target=self._sample, args=(sink,), name="stoker-occupancy", daemon=True)
        self._sampler.start()

    def _sample(self, sink: BatchSink) -> None:
        samples = 0
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                size = sink.size()
            except Exception:  # its framework has shut down (a closed tf.compat.v1 Session)
                return
            self.stats.add_occupancy(size / sink.capacity)
            self.sizer.demand.sample(self.stats.batches_counted(), size)
            samples += 1
            if samples % SIZING_EVERY_SAMPLES == 0:
                self.sizer.update(self.stats.pool_producers())

    def _run(self) -> None:
        try:
            self.receiver.run(self)
        except SinkClosed:
            pass
        except Exception as exc:  # never die silently: surface it to the consumer
            log.exception("receive thread failed")
            self.fail(InputError(f"receive thread failed: {exc!r}"))
        finally:
            with self._socket_owner:
                self._receiver_ended = True
                if self._abandoned:
                    self._close_receiver()

    def close(self) -> None:
        """Stop receiving, wake a blocked delivery, close the sockets. Idempotent, bounded (about 2 s)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.error is None:
            self.error = InputClosedError(f"the input from {self.sources} was closed")
        if self._sink is not None:
            try:
                self._sink.close(cancel=True)
            except Exception:  # its framework may have shut down first (a closed tf.compat.v1 Session)
                pass
        for thread in (self._thread, self._sampler):
            if thread is not None:
                thread.join(2.0)
        with self._socket_owner:
            if not self._receiver_ended:
                # Still inside a libzmq or TensorFlow call: it closes the sockets when it returns.
                log.warning("the receive thread did not stop within 2 s; it closes its sockets when it does")
                self._abandoned = True
                return
            self._close_receiver()

    def _close_receiver(self) -> None:
        if not self._closed_sockets:
            self._closed_sockets = True
            self.pool.close()
            self.receiver.close()
