"""Exact mode's connection to one producer, over libzmq or over our own ZMTP: what ``ExactControlPlane`` uses.

A *link* is a DEALER peer of one producer's ROUTER: it connects (again after a drop),
counts handshakes (each is a new connection, which the control plane greets with a hello),
explains failed ones, sends single-frame control messages without waiting, and hands
over each message that arrived: a producer's status (its map) or a batch. Two kinds:

- ``LibzmqDealer``: a libzmq DEALER socket and its ``ConnectionWatcher``; a batch arrives
  as views of libzmq's frames (the sink copies it into aligned memory). CurveZMQ needs it.
- ``DirectDealer`` (``direct_dealer``): our ZMTP on a loop of a few threads shared by every
  producer, reading each batch straight into memory the sink then owns (no copy).

Both are polled by one ``zmq.Poller``, used by one thread (the control plane's), except that a
``DirectDealer``'s connection reads on its loop's thread: a libzmq link's socket (``pollable``), or the one
pipe of the ``ReadyQueue`` every direct link of the input shares (``ready_queue``), which says which hold a
message.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import zmq

from stoker.protocol import DecodeLimits, ProtocolError, decode_batch
from stoker.protocol.batch_header import Batch
from stoker.protocol.curve import CurveClientKeys
from stoker.protocol.exact_messages import unpack_producer_frame

from stoker.consumer.transport.connections import ConnectionHealth, ConnectionWatcher
from stoker.consumer.transport.libzmq_receiver import set_curve


class Link(Protocol):
    """One producer's connection in exact mode; see the module doc."""

    address: str
    #: batches come in memory the sink may own (``put(owned=True)``), not as views of libzmq's frames
    owned: bool
    handshakes: int
    #: failed handshakes, mode-mismatch refusals (one side runs exact mode, the other not), re-connects
    health: ConnectionHealth

    @property
    def connected(self) -> set[str]:
        """The endpoint while a handshaken connection is up, else empty."""

    @property
    def pollable(self) -> Any:
        """What a ``zmq.Poller`` waits on: readable while a message waits for ``receive``."""

    def watch(self) -> bool:
        """Handle connection events (the control plane's thread, every turn); True if anything changed."""

    def send(self, frame: bytes) -> bool:
        """Queue one control message without waiting; False if not connected (the next connection says hello)."""

    def receive(self) -> tuple[dict, int] | Batch:
        """The next message (one is waiting): a status (its map and size in bytes) or a batch. ProtocolError for
        a bad one."""

    def close(self, linger_ms: int) -> None:
        """Give queued messages up to ``linger_ms`` to leave, then close (without waiting for a thread)."""

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for what ``close`` stopped (a reading thread)."""


class LibzmqDealer:
    """A libzmq DEALER connected to one producer; see the module doc. ValueError for an address libzmq cannot
    parse. Batches are decoded (``decode_batch``) here, not yet held to the spec."""

    owned = False

    def __init__(self, ctx: zmq.Context, address: str, options: Sequence[tuple[int, Any]], limits: DecodeLimits,
                 curve: Optional[CurveClientKeys] = None) -> None:
        self.address = address
        self.limits = limits
        try:
            self.sock = ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:  # EMFILE: the context's MAX_SOCKETS (``libzmq_context``), or the open files
            raise ValueError(f"cannot open a socket for {address}: {exc.strerror} (this trainer's libzmq context "
                             f"opens at most {ctx.get(zmq.MAX_SOCKETS)} sockets, three per producer): connect it to "
                             "fewer producers") from None
        for option, value in options:
            self.sock.setsockopt(option, value)
        set_curve(self.sock, curve)
        try:
            self.watcher = ConnectionWatcher(self.sock, [address], curve=curve is not None)  # connects it
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            raise ValueError(f"cannot connect to {address}: {exc.strerror}; expected e.g. tcp://host:5555") from None

    @property
    def pollable(self) -> zmq.Socket:
        return self.sock

    @property
    def connected(self) -> set[str]:
        return self.watcher.connected

    @property
    def handshakes(self) -> int:
        return self.watcher.handshakes

    @property
    def health(self) -> ConnectionHealth:
        return self.watcher.health

    def watch(self) -> bool:
        return self.watcher.poll()

    def send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def receive(self) -> tuple[dict, int] | Batch:
        try:
            frames = self.sock.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise ProtocolError(f"receive failed: {exc}") from None
        status = unpack_producer_frame(frames[0]) if len(frames) == 1 else None
        if status is not None:
            return status, memoryview(frames[0]).nbytes
        return decode_batch(frames, self.limits)

    def close(self, linger_ms: int) -> None:
        self.watcher.close()
        self.sock.close(linger=linger_ms)  # libzmq lingers in the background; the context's term waits

    def join(self, timeout: float) -> None:
        pass  # no thread of ours
