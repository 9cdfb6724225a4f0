"""One producer's connection as a state machine a selector loop drives (``connection_loop``), on a non-blocking socket.

A ``LoopConnection`` is driven by one loop thread, which serves many: it goes
connect (non-blocking, ``connect_timeout`` with the handshake), the ZMTP handshake and then one message
after another as resumable steps (``zmtp_reader``): each step names the view it needs filled (an array's
own memory for a batch body, so no copy beyond the kernel's) and is resumed when the bytes arrived. What
a connection does with what it reads is its ``Peer``'s (plain receive delivers to the sink; exact mode's
dealer fills an inbox). What the per-thread design guaranteed holds per connection:

- memory: one message being read (its arrays, from the peer's ``empty``) and its frame head;
- fairness: a turn reads at most one whole message or ``TURN_BYTES`` from a connection, then serves the others;
- syscalls: a view smaller than ``AHEAD_BYTES`` (a frame head, a header, a small array) is served from a read-ahead
  buffer that one ``recv`` fills with whatever has arrived, so a batch's small frames cost one read, not two
  each; a larger view (an image array) is read straight into its memory, the buffered bytes copied first;
- backpressure: a connection reads only while ``peer.has_room()``; else TCP holds its producer back;
- reconnects after ``poll_s``, doubling to ``MAX_BACKOFF_S`` while connections fail or end having delivered
  nothing; a peer silent for ``stall_s`` mid-message, or leaving our sends unread as long, is dropped;
- PING answered with PONG (not while our own sends wait); ``peer.leaving()`` closes it within ``poll_s``.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from typing import Any, Callable, Optional, Protocol

from stoker.protocol.errors import ProtocolError

from stoker.consumer.receive.contract import SinkClosed
from stoker.consumer.receive.stream_address import connect_failure, open_stream, stream_address, tune_stream
from stoker.consumer.transport.direct_receive import MAX_BACKOFF_S
from stoker.consumer.transport.zmtp import MAX_UNSENT, STALL_S
from stoker.consumer.transport.zmtp_reader import FrameReader, Steps, handshake_steps
from stoker.consumer.transport.zmtp_wire import encode_frame

#: Bytes one connection may read in one turn of its loop before the others are served.
TURN_BYTES = 4 << 20
#: The read-ahead buffer of a connection: views smaller than this are filled from it (memory: this per producer).
AHEAD_BYTES = 16 << 10

class Peer(Protocol):
    """What one connection does with what it reads; called on its loop's thread, except ``leaving``."""

    endpoint: str
    socket_type: str  # "PULL" or "DEALER"

    def leaving(self) -> bool:
        """True once this connection is to be closed for good (the input stops, the producer left the pool)."""

    def has_room(self) -> bool:
        """Whether another message may be read now (else the connection waits, unread)."""

    def message_steps(self, reader: FrameReader) -> Steps[Any]:
        """The steps that read the next message."""

    def connected(self, connection: "LoopConnection") -> None:
        """A handshake succeeded: ``connection`` is up (it takes ``send`` from any thread)."""

    def refused(self, exc: Exception) -> None:
        """Connecting or the handshake failed (OSError, ProtocolError, SocketTypeMismatch)."""

    def ended(self, exc: Exception, delivered: bool) -> None:
        """A connection that was up ended (``exc`` says why); ``delivered``: it read a message."""

    def message(self, message: Any) -> None:
        """A whole message (may wait; SinkClosed ends the connection for good)."""

    def rejected(self, exc: ProtocolError, in_sync: bool) -> None:
        """A bad message (``in_sync``: skipped to its end, the stream goes on; else the connection is dropped)."""

    def closed(self) -> None:
        """The connection is gone for good (after ``leaving``, a closed sink or the loop's close)."""


class LoopConnection:
    """One producer's connection, driven by one loop thread; see the module doc. ``send`` from any thread."""

    def __init__(self, peer: Peer, poll_s: float, connect_timeout: float = 2.0, stall_s: float = STALL_S) -> None:
        self.peer, self.endpoint = peer, peer.endpoint
        self.address = stream_address(peer.endpoint)  # ValueError for one that is neither tcp://host:port nor ipc://
        self._poll_s, self._connect_timeout, self._stall_s = poll_s, connect_timeout, stall_s
        self.sock: Optional[socket.socket] = None
        self.state = "waiting"  # waiting (to connect), connecting, handshake, open
        self.retry_at = 0.0
        self._backoff = poll_s
        self._deadline = 0.0  # of connecting and the handshake
        self.reader = FrameReader(self._pong)
        self._steps: Optional[Steps[Any]] = None
        self._view = memoryview(b"")
        self._ahead = memoryview(bytearray(AHEAD_BYTES))
        self._ahead_from = self._ahead_to = 0  # the bytes read ahead, not yet taken by the steps
        self._progress_at = 0.0
        self._delivered = False
        self._out = bytearray()
        self._out_since = 0.0
        self._out_lock = threading.Lock()
        self.events = 0  # what the loop's selector waits for on ``sock``
        self.tick_at = float("inf")  # the earliest time the loop's heap of timers holds for this connection
        self.wake: Callable[[], None] = lambda: None  # set by the loop: look at this connection now (sends, room)
        self.forget: Callable[[socket.socket], None] = lambda sock: None  # set by the loop: unregister before close

    # ---- sending (any thread) -------------------------------------------------------------------------

    def send(self, frame: bytes) -> bool:
        """Queue a one-frame message and write what the socket takes now (never waits); False if not up."""
        try:
            self._queue(encode_frame(frame))
        except OSError:
            return False
        return True

    @property
    def unsent(self) -> int:
        return len(self._out)

    def flush(self) -> None:
        """Write what the socket takes of the queued bytes; OSError once closed or stalled."""
        with self._out_lock:
            self._write()

    def _pong(self, frame: bytes) -> None:
        if not self._out:  # a peer that reads nothing gets no more than one
            self._queue(frame)

    def _queue(self, data: bytes) -> None:
        with self._out_lock:
            if self.state not in ("handshake", "open") or self.sock is None:
                raise ConnectionError(f"the connection to {self.endpoint} is closed")
            if len(self._out) + len(data) > MAX_UNSENT:
                raise ConnectionError(f"{self.endpoint} left {len(self._out)} queued bytes unread: dropped")
            if not self._out:
                self._out_since = time.monotonic()
            self._out += data
            self._write()
        if self._out:
            self.wake()

    def _write(self) -> None:
        """Caller holds ``_out_lock``."""
        if self.sock is None:
            raise ConnectionError(f"the connection to {self.endpoint} is closed")
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                break
            del self._out[:sent]

    # ---- driven by the loop's thread --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Timers: connect when due, the handshake's deadline, stalls, reading again once there is room."""
        if self.state == "waiting":
            if now >= self.retry_at:
                self._connect(now)
            return
        if self.state in ("connecting", "handshake") and now > self._deadline:
            error: Exception = TimeoutError(f"connecting to {self.endpoint} took too long") \
                if self.state == "connecting" else \
                ProtocolError(f"{self.endpoint} did not complete the ZMTP handshake in time: is it a Stoker producer?")
            self._fail(error)
            return
        if self.state == "connecting":
            return
        self._read_ahead_bytes()  # before judging silence: bytes that sat here are no stall
        if self.state not in ("handshake", "open"):
            return
        # Only while reading: a message read whole leaves ``in_message`` set while its peer waits for room (any time).
        stalled = self._steps is not None and self.reader.in_message and now - self._progress_at > self._stall_s
        if stalled or (self._out and now - self._out_since > self._stall_s):
            why = "sent nothing" if stalled else "left our queued bytes unread"
            self._fail(ConnectionError(f"{self.endpoint} {why} for {self._stall_s:g} s in the middle of a message: "
                                       "dropped"))
            return
        if self.state == "open" and self._steps is None and self.peer.has_room():
            self._next_message()
        self._read_ahead_bytes()

    def _read_ahead_bytes(self) -> None:
        """Serve the bytes read ahead, if steps wait for them: the socket may have no more to signal."""
        if self._steps is not None and self._ahead_to > self._ahead_from:
            try:
                self._read()
            except (OSError, ProtocolError) as exc:
                self._fail(exc)

    def next_tick(self, now: float) -> float:
        """When ``tick`` next has work (the loop's heap of timers ticks it then, or earlier; inf: only an event, a
        read or a ``wake``, brings work): a connect or handshake deadline, a stall bound, the retry, or, while a
        message waits for room, ``poll_s`` from now (its peer's ``wake`` is sooner)."""
        if self.state == "closed":
            return now  # closed by its own failure (a closed sink): the loop forgets it on its next turn
        if self.state == "waiting":
            return self.retry_at
        at = self._deadline if self.state in ("connecting", "handshake") else float("inf")
        if self._steps is not None and self.reader.in_message:
            at = min(at, self._progress_at + self._stall_s)
        if self._out:
            at = min(at, self._out_since + self._stall_s)
        if self.state == "open" and self._steps is None:
            at = min(at, now + self._poll_s)
        return at

    def _connect(self, now: float) -> None:
        try:
            sock, address = open_stream(self.address)
        except OSError as exc:
            self._fail(exc)
            return
        self.sock, self.state, self._deadline = sock, "connecting", now + self._connect_timeout
        failure = connect_failure(sock, sock.connect_ex(address), self.endpoint)
        if failure is not None:
            self._fail(failure)

    def ready(self, mask: int) -> None:
        """The selector says the socket is writable and/or readable."""
        if self.state == "connecting":
            assert self.sock is not None
            error = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                self._fail(ConnectionRefusedError(error, os.strerror(error)))
                return
            self._opened()
            return
        try:
            if mask & selectors.EVENT_WRITE:
                self.flush()
            if mask & selectors.EVENT_READ and self._steps is not None:
                self._read()
        except (OSError, ProtocolError) as exc:
            self._fail(exc)

    def _opened(self) -> None:
        sock = self.sock
        assert sock is not None
        tune_stream(sock)
        self.state, self._progress_at = "handshake", time.monotonic()
        self.reader = FrameReader(self._pong)
        self._start(handshake_steps(self.reader, self.endpoint, self.peer.socket_type, self._queue))

    def _start(self, steps: Steps[Any]) -> None:
        self._steps = steps
        self._resume(lambda: next(steps))

    def _next_message(self) -> None:
        self._start(self.peer.message_steps(self.reader))

    def _read(self) -> None:
        """Fill the steps' views from the read-ahead bytes and the socket until it has nothing more, a message
        ended, or the turn's bytes."""
        assert self.sock is not None
        budget = TURN_BYTES
        while self._steps is not None:
            view = self._view
            if self._ahead_to > self._ahead_from:  # served whatever the turn's budget: no event would bring them
                got = min(view.nbytes, self._ahead_to - self._ahead_from)
                view[:got] = self._ahead[self._ahead_from:self._ahead_from + got]
                self._ahead_from += got
                self._progress_at = time.monotonic()  # what it has sat there is not the peer's silence
            elif budget <= 0:
                return  # the others' turn; the socket still holds bytes, so the selector brings this one back
            else:
                into = view if view.nbytes >= AHEAD_BYTES else self._ahead
                try:
                    got = self.sock.recv_into(into)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    self._resume(lambda: self._steps.throw(exc))  # type: ignore[union-attr]
                    return
                if not got:
                    closed = ConnectionError(f"{self.endpoint} closed the connection")
                    self._resume(lambda: self._steps.throw(closed))  # type: ignore[union-attr]
                    return
                self._progress_at = time.monotonic()
                budget -= got
                if into is self._ahead:
                    self._ahead_from, self._ahead_to = 0, got
                    continue
            self._view = view[got:]
            if not self._view.nbytes:
                steps = self._steps
                if self._resume(lambda: steps.send(None)):
                    if self._steps is not None and self._ahead_to > self._ahead_from:
                        self.wake()  # the next message has begun in the read-ahead bytes: no event will say so
                    return  # one whole message a turn: the other connections' turn

    def _resume(self, step: Any) -> bool:
        """Run the steps on to the next view they need; True when they ended (a message, a handshake or an error)."""
        try:
            self._view = step()
            return False
        except StopIteration as done:
            self._steps, value = None, done.value
        except ProtocolError as exc:
            self._steps = None
            if self.state != "open":
                self._fail(exc)
                return True
            self.peer.rejected(exc, self.reader.in_sync)
            if not self.reader.in_sync:
                self._fail(exc)
            elif self.peer.has_room():
                self._next_message()
            return True
        except OSError as exc:
            self._steps = None
            self._fail(exc)
            return True
        try:
            self._finished(value)
        except SinkClosed as exc:
            self._fail(exc)
        return True

    def _finished(self, message: Any) -> None:
        if self.state == "handshake":
            self.state = "open"
            self.peer.connected(self)
        else:
            self._delivered = True
            self.peer.message(message)  # may wait for room; SinkClosed ends this connection for good
        if self.state == "open" and self.peer.has_room():
            self._next_message()

    def _fail(self, exc: Exception) -> None:
        """Close the socket; report why; wait before connecting again (``closed`` for a closed sink)."""
        was_open = self.state == "open"
        self._close_socket()
        if isinstance(exc, SinkClosed):
            self.state = "closed"
            return
        if was_open:
            self.peer.ended(exc, self._delivered)
        else:
            self.peer.refused(exc)
        if was_open:  # as a refusal, a connection that ends having delivered nothing doubles the wait
            self._backoff = self._poll_s if self._delivered else min(MAX_BACKOFF_S, self._backoff * 2)
            wait = self._backoff
        else:
            wait, self._backoff = self._backoff, min(MAX_BACKOFF_S, self._backoff * 2)
        self.retry_at = time.monotonic() + wait
        self._delivered = False

    def _close_socket(self) -> None:
        with self._out_lock:  # never while another thread writes: the descriptor could be reused under it
            sock, self.sock = self.sock, None
            self._out.clear()
            self.state = "waiting"
            if sock is not None:
                self.forget(sock)
                sock.close()
        self._steps, self._view = None, memoryview(b"")
        self._ahead_from = self._ahead_to = 0  # the next connection's stream starts afresh

    def close(self) -> None:
        self._close_socket()
        self.state = "closed"

    def reset(self) -> None:
        """After an unexpected failure (logged by the loop): close and connect again after the backoff."""
        self._close_socket()
        self.retry_at = time.monotonic() + self._backoff

    def wanted(self) -> int:
        """The selector events this connection waits for now (0: none)."""
        if self.state == "connecting":
            return selectors.EVENT_WRITE
        if self.state not in ("handshake", "open"):
            return 0
        return (selectors.EVENT_READ if self._steps is not None else 0) | (selectors.EVENT_WRITE if self._out else 0)
