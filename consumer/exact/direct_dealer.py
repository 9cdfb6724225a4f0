"""Exact mode over our own ZMTP: a DEALER peer of one producer that reads batches into memory the sink owns.

A ``DirectDealer`` is the ``Peer`` (``loop_connection``) of one non-blocking connection on a
``ConnectionLoop`` shared by every producer of the input (``ExactReceiver`` owns it: a bounded number
of threads however many producers; a dealer made without one runs a loop of one thread of its own).
The loop connects (again every 0.1-1 s while refused, and after a drop), says READY as a DEALER,
then reads each message: a producer's status, or a batch held to the trainer's spec by its header
and read straight into ``empty()`` memory, as plain direct receive does (``message_steps``), so
TensorFlow takes it without a copy. Messages wait in an inbox for the control plane's thread
(``receive``); a link whose inbox holds one is queued in a ``ReadyQueue`` (``ready_queue``) shared by every
link of the input, whose one pipe a ``zmq.Poller`` waits on: a receive call costs the links ready, not
the links (a dealer made without a queue has one of its own, ``pollable``). The inbox
is bounded: at ``batch_room`` batches (credit keeps an honest producer below it) or ``status_room``
other messages (statuses, errors) the connection stops reading, and TCP holds the producer back;
``receive`` wakes it once there is room again. A bad message is handed over as its ProtocolError
(counted; in a pool the producer starts afresh); a stream that cannot be followed is dropped and
connected again, and every new connection counts as a handshake (the control plane says hello on
it). ``send`` never waits (``LoopConnection.send``); ``close`` gives queued messages ``linger_ms`` to
leave and lets the loop close the connection, which ``join`` waits for (within about ``poll_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from stoker.protocol import DecodeLimits, ProtocolError
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import BatchSpec

from stoker.consumer.receive.stream_address import stream_address
from stoker.consumer.transport.connection_loop import ConnectionLoop
from stoker.consumer.transport.connections import ConnectionHealth
from stoker.consumer.transport.direct_receive import EmptyArray, message_steps
from stoker.consumer.transport.loop_connection import LoopConnection
from stoker.consumer.transport.ready_queue import ReadyQueue
from stoker.consumer.transport.zmtp import SocketTypeMismatch
from stoker.consumer.transport.zmtp_reader import FrameReader, Steps

log = logging.getLogger("stoker.consumer")

Message = Batch | tuple[dict, int] | ProtocolError


class DirectDealer:
    """One exact-mode producer over our ZMTP; see the module doc. ValueError for an address that is not
    tcp://host:port, or once ``loop`` is closed. ``spec()`` is the trainer's batch spec once known (batches before it
    are refused). ``loop``: what drives the connection (None: a loop of one thread, the dealer's own, which ``join``
    closes). ``ready``: where the dealer queues itself while its inbox holds a message (None: a queue of its own,
    whose pipe is ``pollable``)."""

    owned = True

    def __init__(self, address: str, spec: Callable[[], Optional[BatchSpec]], limits: DecodeLimits,
                 empty: EmptyArray, batch_room: int, status_room: int, poll_s: float = 0.1,
                 loop: Optional[ConnectionLoop] = None, ready: Optional[ReadyQueue] = None) -> None:
        stream_address(address)
        self.address = self.endpoint = address
        self._spec, self._limits, self._empty = spec, limits, empty
        self._batch_room, self._status_room = batch_room, status_room
        self.handshakes = 0
        self.health = ConnectionHealth()  # failed handshakes, mode-mismatch refusals, re-connects
        self._up: Optional[LoopConnection] = None  # the connection while handshaken
        self._changed = False
        #: called (on the loop's thread) after the connection changed: the control plane looks at this link then only
        self.on_change: Callable[[], None] = lambda: None
        self._inbox: deque[Message] = deque()
        self._batches = self._others = 0  # in the inbox: batches, and statuses or errors
        self._lock = threading.Lock()
        self._own_queue = ready is None
        #: holds this dealer exactly while its inbox holds a message
        self.ready_queue = ready if ready is not None else ReadyQueue()
        self._leave = threading.Event()  # close() was called: the loop closes the connection
        self._gone = threading.Event()  # the loop closed it (``closed``): the pipe is closed too
        self._own_loop = loop is None
        self._loop = loop if loop is not None else ConnectionLoop(f"stoker-exact-{address}", poll_s,
                                                                  lambda endpoint, exc: None, max_threads=1)
        self._connection = LoopConnection(_DealerPeer(self), poll_s)
        try:
            self._loop.add(self._connection)
        except RuntimeError:  # the shared loop closed: the input stops
            self.closed()
            raise ValueError(f"cannot connect to {address}: the input is closing") from None

    # ---- for the control plane's thread ---------------------------------------------------------------

    @property
    def pollable(self) -> int:
        return self.ready_queue.pollable

    @property
    def connected(self) -> set[str]:
        conn = self._up  # and "open": a connection reset after an unexpected failure (the loop's on_error) is not up
        return {self.address} if conn is not None and conn.state == "open" else set()

    def watch(self) -> bool:
        # Queued sends need no flush here: the loop writes them as the socket takes them.
        with self._lock:
            changed, self._changed = self._changed, False
        return changed

    def send(self, frame: bytes) -> bool:
        conn = self._up
        return conn is not None and conn.send(frame)

    def receive(self) -> Batch | tuple[dict, int]:
        with self._lock:
            full = not self._has_room()
            message = self._inbox.popleft()
            if not self._inbox:
                self.ready_queue.drained(self)
            if isinstance(message, Batch):
                self._batches -= 1
            else:
                self._others -= 1
        if full:  # the connection stopped reading for want of room: read on now, not at the loop's next tick
            self._connection.wake()
        if isinstance(message, ProtocolError):
            raise message
        return message

    def close(self, linger_ms: int) -> None:
        """Write what is queued (at least one try, then up to ``linger_ms``), then have the loop close the connection
        without waiting for it (``join``)."""
        deadline = time.monotonic() + linger_ms / 1000
        conn = self._up
        while conn is not None:
            try:
                conn.flush()
            except OSError:
                break
            if not conn.unsent or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        self._leave.set()
        self._connection.wake()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the loop to close the connection (after ``close``), which closes the pipe; a
        dealer's own loop stops then."""
        deadline = time.monotonic() + timeout
        if not self._gone.wait(timeout):
            log.warning("the exact connection to %s still open after the stop", self.address)
        if self._own_loop:
            self._loop.close(max(0.0, deadline - time.monotonic()))

    # ---- the loop's thread (through ``_DealerPeer``) -------------------------------------------------------

    def leaving(self) -> bool:
        return self._leave.is_set()

    def _has_room(self) -> bool:
        return self._batches < self._batch_room and self._others < self._status_room

    def has_room(self) -> bool:
        with self._lock:
            return self._has_room()

    def message_steps(self, reader: FrameReader) -> Steps[Batch | tuple[dict, int]]:
        return message_steps(reader, self._spec(), self._limits, self._empty, statuses=True)

    def handshaken(self, connection: LoopConnection) -> None:
        with self._lock:
            self._up = connection
            self.handshakes += 1
            self.health.succeeded(self.address)
            self._changed = True
        self.on_change()

    def refused(self, exc: Exception) -> None:
        with self._lock:
            if isinstance(exc, ProtocolError) and \
                    self.health.failed(self.address, str(exc), isinstance(exc, SocketTypeMismatch)) == 1:
                log.warning("handshake with %s failed: %s", self.address, exc)
            self._changed = True
        self.on_change()

    def ended(self, exc: Exception, delivered: bool) -> None:
        log.info("exact connection to %s ended: %s", self.address, exc)
        with self._lock:
            self._up = None
            self._changed = True
            self.health.reconnects += 1  # a connection that ended and will be made again
        self.on_change()

    def message(self, message: Batch | tuple[dict, int]) -> None:
        self._post(message)

    def rejected(self, exc: ProtocolError, in_sync: bool) -> None:
        self._post(exc)  # counted by the control plane; out of sync, the connection drops it and connects again

    def closed(self) -> None:
        """Gone for good: out of the ready queue (the control plane reads a closed link no more; its own queue's
        pipe is closed)."""
        with self._lock:
            self._up = None
            if not self._gone.is_set():
                self.ready_queue.drained(self)
                if self._own_queue:
                    self.ready_queue.close()
            self._gone.set()

    def _post(self, message: Message) -> None:
        with self._lock:
            self._inbox.append(message)
            if isinstance(message, Batch):
                self._batches += 1
            else:
                self._others += 1
            if len(self._inbox) == 1 and not self._gone.is_set():
                self.ready_queue.ready(self)


class _DealerPeer:
    """A dealer as its connection's ``loop_connection.Peer``: the same methods, but ``connected`` is the Peer's call
    here (a link's ``connected`` is the set of endpoints up)."""

    socket_type = "DEALER"

    def __init__(self, dealer: DirectDealer) -> None:
        self.endpoint = dealer.address
        self.leaving, self.has_room, self.message_steps = dealer.leaving, dealer.has_room, dealer.message_steps
        self.connected, self.refused, self.ended = dealer.handshaken, dealer.refused, dealer.ended
        self.message, self.rejected, self.closed = dealer.message, dealer.rejected, dealer.closed
