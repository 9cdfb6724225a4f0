"""Plain mode through libzmq: one PULL socket connected to every producer (the path for CurveZMQ).

libzmq reconnects by itself, so producers may start before or after the trainer. Each
message is decoded with ``stoker.protocol`` (zero-copy views of libzmq's frames; the sink
copies them once into aligned memory) and held to the spec. A ``ConnectionWatcher`` counts
a producer as connected after the ZMTP handshake and explains failed handshakes.

Memory bound, and its limit: libzmq assembles a whole multipart message before we see
it, and ``ZMQ_MAXMSGSIZE`` limits a frame, not a message, so a peer that sends frames with
MORE set forever grows this process without bound. Against unauthorised peers that is
closed by CurveZMQ (only producers holding an authorised key get past the handshake);
without CurveZMQ the direct receiver, which bounds every message, is the default for
tcp:// (docs/security.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import zmq

from stoker.protocol import ProtocolError, decode_batch
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.receive.contract import POLL_S, ReceiveContext
from stoker.consumer.transport.connections import ConnectionWatcher
from stoker.consumer.transport.discovery import ProducerPool
from stoker.consumer.transport.connection_loop import reserve_descriptors

if TYPE_CHECKING:
    from stoker.consumer.receive.options import ReceiveOptions

log = logging.getLogger("stoker.consumer")


def socket_options(rcvhwm: int, max_message_bytes: int) -> tuple[tuple[int, Any], ...]:
    """The options every trainer-side libzmq socket gets (PULL, or exact mode's DEALERs)."""
    return (
        (zmq.RCVHWM, rcvhwm),
        (zmq.MAXMSGSIZE, max_message_bytes),
        (zmq.LINGER, 0),
        (zmq.RECONNECT_IVL, 100),
        (zmq.RECONNECT_IVL_MAX, 1000),
        # A dead peer (a killed host, a cut link) is found by TCP, not by ZMTP heartbeats: keepalive probes
        # (idle 5 s, then 3 x 1 s) and, for what this side sent, a 10 s user timeout drop the connection, and
        # libzmq connects again. Not ZMTP heartbeats: a socket whose receive pipe is full (a slow step) stops
        # reading, so it cannot see the peer's traffic, and its heartbeat timeout then kills a healthy
        # connection; the reconnect races with libzmq's stale "resume reading" and aborts the process
        # (`Assertion failed: _input_stopped (src/stream_engine_base.cpp)`, libzmq issues #3937 and #4767,
        # open). Keepalive probes are answered by the peer's kernel however full the pipe is.
        (zmq.TCP_KEEPALIVE, 1),
        (zmq.TCP_KEEPALIVE_IDLE, 5),
        (zmq.TCP_KEEPALIVE_INTVL, 1),
        (zmq.TCP_KEEPALIVE_CNT, 3),
        (zmq.TCP_MAXRT, 10_000),
    )


#: Sockets a libzmq link of exact mode opens (``links.LibzmqDealer``): its DEALER and its monitor's pair.
LIBZMQ_SOCKETS_PER_DEALER = 3


def libzmq_context(sockets: int) -> zmq.Context:
    """A context that may open ``sockets`` sockets, and as many again for producers joining later (libzmq's default
    is 1,023 a context); ValueError naming the limit when this libzmq cannot (its ``SOCKET_LIMIT``)."""
    ctx = zmq.Context()
    limit, default = ctx.get(zmq.SOCKET_LIMIT), ctx.get(zmq.MAX_SOCKETS)
    if sockets > limit:
        ctx.term()
        raise ValueError(f"{sockets} libzmq sockets are needed but this libzmq opens at most {limit} in one context: "
                         "connect this trainer to fewer producers, or (without CurveZMQ) use direct receive, which "
                         "opens none")
    if 2 * sockets > default:
        ctx.set(zmq.MAX_SOCKETS, min(limit, 2 * sockets))  # before the first socket: libzmq fixes it then
    return ctx


def set_curve(sock: zmq.Socket, curve: Optional[CurveClientKeys]) -> None:
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve.public, curve.secret, \
            curve.server_public


class LibzmqReceiver:
    """See the module doc. ValueError for an address libzmq cannot parse."""

    def __init__(self, pool: ProducerPool, options: "ReceiveOptions") -> None:
        self.pool = pool
        self.limits = limits = options.limits
        rcvhwm, curve = options.rcvhwm, options.curve
        self.held_per_producer = rcvhwm + 1  # ZMQ's receive buffer plus the message it is assembling
        reserve_descriptors(len(pool.endpoints))  # one socket, but a connection (an open file) per producer
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        for option, value in socket_options(rcvhwm, limits.max_message_bytes):
            self._sock.setsockopt(option, value)
        set_curve(self._sock, curve)
        try:  # the watcher connects, after its monitor runs: no handshake goes unseen
            self._watcher = ConnectionWatcher(self._sock, pool.endpoints, curve=curve is not None)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise ValueError(f"cannot connect to the producer addresses {pool.endpoints}: {exc.strerror}; "
                             "expected e.g. tcp://host:5555") from None
        self._first: Optional[Any] = None  # the batch a spec was learned from, delivered first

    def resolve_spec(self, declared: Optional[BatchSpec], context: ReceiveContext) -> BatchSpec:
        return declared if declared is not None else context.learn_spec(lambda: self._learn(context),
                                                                         "waited for a first batch to learn it from")

    def _learn(self, context: ReceiveContext) -> Optional[BatchSpec]:
        """One turn of learning the spec: the spec of the first batch that decodes, delivered first later."""
        self._watch(context)
        if not self._sock.poll(int(POLL_S * 1000)):
            return None
        try:
            batch = decode_batch(self._sock.recv_multipart(copy=False), self.limits)
            learned = BatchSpec.of(batch)
        except (ProtocolError, ValueError) as exc:
            context.reject(exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc)))
            return None
        log.info("learned the batch spec from producer %s: %s", batch.header.producer, learned)
        self._first = batch
        return learned

    def run(self, context: ReceiveContext) -> None:
        sock, spec = self._sock, context.spec
        if self._first is not None:
            first, self._first = self._first, None
            context.deliver(first, spec.check(first), owned=False)
        while True:
            self._watch(context)
            # Checked on every turn, not only when the socket is idle: a stream of rejected
            # messages (a misconfigured producer, a wrong peer) must not keep the step waiting.
            if not context.watch():
                return
            try:  # receive first, poll only when nothing waits: one libzmq call per batch under load
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                sock.poll(int(POLL_S * 1000))
                continue
            except zmq.ZMQError as exc:  # e.g. a frame over MAXMSGSIZE drops the connection
                context.reject(ProtocolError(f"receive failed: {exc}"))
                continue
            try:
                batch = decode_batch(frames, self.limits)
                arrays = spec.check(batch)
            except ProtocolError as exc:
                context.reject(exc)
                continue
            context.deliver(batch, arrays, owned=False)  # may block on a full queue: not silence from the producers

    def _add(self, endpoint: str) -> None:
        try:
            self._watcher.add(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(exc.strerror) from None

    def _watch(self, context: ReceiveContext) -> None:
        changed = context.follow_pool(self._add, self._watcher.remove)
        if self._watcher.poll() or changed:
            w = self._watcher
            count, _, reason = w.health.summary()
            context.stats.set_connections(w.connected, count, reason, w.health.reconnects)

    def failures(self) -> tuple[int, str, str]:
        return self._watcher.health.summary()

    def mode_mismatches(self) -> dict[str, int]:
        return self._watcher.health.mismatches()

    def waiting_report(self) -> list[str]:
        return []

    def close(self) -> None:
        self._watcher.close()
        self._sock.close(linger=0)
        self._ctx.term()

