"""Exact mode's receiver: ``ExactControlPlane`` (a DEALER link per producer, credit, hellos) driven for the core.

Receives only while the sink has room (credit: one batch per batch queued), never blocking,
so heartbeats and consumed-record reports keep going while a step is slow. Each delivered
batch carries one more array, ``stoker_source`` (which producer it came from), so the
records a step consumes are reported to that producer. What to keep of each batch is the control
plane's one answer (``admit``: dropped if sent under an older session, whose records are served again;
an elastic pool's mask cut to the records that arrive first); this receiver only receives. A producer's status keeps the input alive
while it waits (for more trainers, or for steps to report). ``direct``: each link speaks our
own ZMTP and reads batches into memory the sink owns (``direct_dealer``, no copy), every link's
connection driven by one ``ConnectionLoop`` of at most ``MAX_THREADS - 1`` threads (with the control
plane's, ``MAX_THREADS`` receive threads however many producers); else libzmq DEALERs
(``links.LibzmqDealer``, which CurveZMQ needs), in a context sized for three sockets a producer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import zmq

from stoker.protocol import ProtocolError
from stoker.protocol.batch_spec import BatchSpec

from stoker.consumer.exact.direct_dealer import DirectDealer
from stoker.consumer.transport.ready_queue import ReadyQueue
from stoker.consumer.transport.connection_loop import MAX_THREADS, ConnectionLoop, reserve_descriptors
from stoker.consumer.transport.discovery import ProducerPool
from stoker.consumer.exact.links import Link, LibzmqDealer
from stoker.consumer.receive.errors import InputError
from stoker.consumer.exact.control_plane import ExactControlPlane
from stoker.consumer.transport.libzmq_receiver import LIBZMQ_SOCKETS_PER_DEALER, libzmq_context, socket_options
from stoker.consumer.receive.contract import POLL_S, ReceiveContext, aligned_empty

if TYPE_CHECKING:
    from stoker.consumer.receive.options import ReceiveOptions

log = logging.getLogger("stoker.consumer")

_WAITING_LOG_EVERY_S = 10.0
#: Messages a link holds beyond the batches credit allows (a libzmq DEALER's receive pipe, a direct link's inbox):
#: an hour of status messages (one a second) while the trainer is not reading (a full queue). A full libzmq pipe
#: stops libzmq reading the connection, so it would miss a producer's death, and a disconnect found while it is
#: stopped can abort the process inside libzmq (issue #3937, docs/decisions.md). Batches stay bounded by credit
#: (an honest producer sends no more; a direct link stops reading past credit + 1).
STATUS_ROOM = 3600


def _plain_empty(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Memory for a column beside libzmq's read-only frames (the sink copies the batch anyway)."""
    return np.empty(shape, dtype)


class ExactReceiver:
    """See the module doc. ValueError for an address the control plane cannot parse."""

    def __init__(self, pool: ProducerPool, options: "ReceiveOptions") -> None:
        if options.ledger is None:
            raise ValueError("ExactReceiver serves exact mode: build the options with exact=True")
        limits, rcvhwm, curve, direct = options.limits, options.rcvhwm, options.curve, options.direct
        self.pool = pool
        self.ledger = ledger = options.ledger
        self.limits = limits
        self.held_per_producer = rcvhwm + 1
        self._spec: Optional[BatchSpec] = None  # direct links hold batches to it by their headers
        self._core: Optional[ReceiveContext] = None
        sockopts = socket_options(rcvhwm + STATUS_ROOM, limits.max_message_bytes)
        # Direct links: one loop drives every producer's connection on at most MAX_THREADS - 1 threads (the control
        # plane's is the last one), and the libzmq context opens no socket; libzmq links: three sockets per producer.
        self._loop = ConnectionLoop("stoker-exact-receive", POLL_S, _loop_failure, MAX_THREADS - 1) if direct else None
        # Direct links: one wake-up pipe and ready queue for all of them, so a receive call costs the links ready.
        self._ready = ReadyQueue() if direct else None
        self._ctx = libzmq_context(0 if direct else LIBZMQ_SOCKETS_PER_DEALER * len(pool.endpoints))
        self._built = False  # the control plane is made: later links are producers joining the pool

        def connect(address: str) -> Link:
            # Open files: direct, a socket (the ready queue's pipe is shared); libzmq, the connection and three
            # mailboxes.
            try:
                reserve_descriptors(len(self.control_plane.live()) + 1 if self._built else len(pool.endpoints),
                                    1 if direct else 4)
            except OSError as exc:
                raise ValueError(str(exc)) from None  # a joining producer's connection error, or the input's
            if self._loop is not None:
                return DirectDealer(address, lambda: self._spec, limits, self._empty, rcvhwm + 1, STATUS_ROOM, POLL_S,
                                    self._loop, self._ready)
            return LibzmqDealer(self._ctx, address, sockopts, limits, curve)

        try:
            self.control_plane = ExactControlPlane(connect, pool.endpoints, ledger, rcvhwm, options.share,
                                                   options.stall_after, options.stall_limit)
        except ValueError:
            if self._loop is not None:
                self._loop.close()
            self._close_ready()
            self._ctx.destroy(linger=0)
            raise
        self._built = True
        self._waiting_logged_at = -_WAITING_LOG_EVERY_S
        # Failed handshakes over every link, taken again only when a link's connection changed (``_watch``): the
        # core asks for them with every batch delivered, and a sum over 1,024 links per batch was most of its CPU.
        self._failures = self.control_plane.failures()
        self._mismatches = self._link_mismatches()  # the same for mode refusals, which the core asks every turn

    def _empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Memory a direct link reads a batch array into: the sink's, once the core runs."""
        core = self._core
        return core.empty(dtype, shape) if core is not None else aligned_empty(dtype, shape)

    def resolve_spec(self, declared: Optional[BatchSpec], context: ReceiveContext) -> BatchSpec:
        """The declared spec plus ``mask``, or ask the producers to describe their batches (nothing is received)."""
        self._core = context
        if declared is not None:
            return declared
        return context.learn_spec(lambda: self._describe_turn(context), "asked the producers to describe their "
                                  "batches")

    def _describe_turn(self, context: ReceiveContext) -> Optional[BatchSpec]:
        self._watch(context)
        for i in self.control_plane.poll(int(POLL_S * 1000)):
            try:
                self.control_plane.receive(i)  # before a hello only status can come
            except ProtocolError as exc:
                context.reject(exc)
        described = self.control_plane.spec()
        if described is None:
            return None
        learned = BatchSpec.from_dict({n: (d, shape) for n, d, shape in described})
        log.info("producers describe their batches: %s", learned)
        return learned

    def run(self, core: ReceiveContext) -> None:
        try:
            self._run(core)
        finally:  # however it ends (a stop, a closed sink mid-delivery): the last steps' records reach their producers
            self.control_plane.flush(force=True)

    def _run(self, core: ReceiveContext) -> None:
        plane, spec = self.control_plane, core.spec
        self._core, self._spec = core, spec
        batch_size, control = spec.batch_size, plane.control
        plane.configure(spec)  # what admit() holds batches to; an elastic pool's splits are whole batches of it
        while True:
            self._watch(core)
            plane.flush()
            core.stats.set_control(control.sent, control.bytes_sent, control.received, control.bytes_received,
                                   control.heartbeat_bytes, control.status_bytes)
            core.stats.set_pool_work(*plane.pool_counters(), plane.stall_warnings)
            if plane.stall_error is not None:
                core.fail(InputError(plane.stall_error))
                return
            if plane.finished:
                plane.flush(force=True)  # the pool's "finished" and the last records go before the sockets close
                core.finish(plane.links.skipped())
                return
            queued, room = core.fill() if plane.active else (0, 0)
            if not plane.active or queued > 0:
                core.alive()  # the step is not waiting for data: not silence
            if not core.watch():
                return
            if room <= 0:
                plane.queue_full()
                time.sleep(0.02)
                continue
            for i in plane.poll(int(POLL_S * 1000), room):  # at most room links: the others wait their turn
                try:
                    batch = plane.receive(i)
                    if batch is None:  # a status: the producer is alive, perhaps waiting for steps to report
                        core.alive()
                        producer = plane.producers[i]
                        if producer.session and producer.status.session == producer.session:
                            # An answer to our hello or later: a describe's answer (session 0) predates our joining.
                            self._log_waiting(producer.status)
                        continue
                    arrays = plane.admit(i, batch, spec.check)  # its mask cut to the rows this trainer keeps
                except ProtocolError as exc:
                    core.reject(exc)
                    plane.rejected(i)
                    continue
                if arrays is None:
                    continue  # an older session's, or nothing new of a pool's: the control plane saw to it
                owned = plane.owned(i)  # in memory the sink may own (direct links), or views of libzmq's frames
                source = self.ledger.source_column(i, batch_size, core.empty if owned else _plain_empty)
                core.deliver(batch, [*arrays, source], owned=owned)
                plane.queued(i, batch["epoch"], batch["index"], batch["mask"])
                room -= 1  # steps only make more room: asked again on the next turn
                if room <= 0:
                    break

    def _watch(self, core: ReceiveContext) -> None:
        changed = core.follow_pool(self.control_plane.add, self.control_plane.remove)
        if self.control_plane.watch() or changed:
            t = self.control_plane
            self._failures = count, _, reason = t.failures()
            self._mismatches = self._link_mismatches()
            core.stats.set_connections(t.connected(), count, reason, sum(link.health.reconnects for link in t.live_links()))

    def _log_waiting(self, status: Any) -> None:
        """Say (every 10 s) that a producer waits for more trainers: a synchronous job waits for all of them."""
        now = time.monotonic()
        if status is None or status.waiting <= 0 or now - self._waiting_logged_at < _WAITING_LOG_EVERY_S:
            return
        self._waiting_logged_at = now
        log.warning("producer %s serves nothing until %d more trainer(s) join (it runs --min-trainers); "
                    "start the other trainers, or the producers with a smaller --min-trainers", status.producer,
                    status.waiting)

    def failures(self) -> tuple[int, str, str]:
        """``(count, endpoint, reason)`` of failed handshakes, as of the last connection change (any thread)."""
        return self._failures

    def waiting_report(self) -> list[str]:
        """Per producer, what this trainer waits for (``ExactControlPlane.waiting_report``)."""
        return self.control_plane.waiting_report()

    def mode_mismatches(self) -> dict[str, int]:
        """Handshakes refused for a mode mismatch, per endpoint, as of the last connection change (any thread)."""
        return self._mismatches

    def _link_mismatches(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for link in self.control_plane.live_links():
            out.update(link.health.mismatches())
        return out

    def close(self) -> None:
        self.control_plane.close()  # each link closed: the loop's threads have nothing left to serve
        if self._loop is not None:
            self._loop.close()
        self._close_ready()
        self._ctx.term()

    def _close_ready(self) -> None:
        if self._ready is not None:
            self._ready.close()  # after the loop closed: no link queues itself any more


def _loop_failure(endpoint: str, exc: Exception) -> None:
    """An unexpected failure in a direct link (logged by the loop): its connection starts again, as a dropped one
    does; the control plane says hello on the new one."""
