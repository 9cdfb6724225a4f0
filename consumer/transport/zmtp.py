"""One ZMTP 3 connection (NULL mechanism, as a PULL or DEALER peer), reading into memory we own.

libzmq delivers each frame in memory it allocated itself, 8-byte aligned, so TensorFlow can
take a frame only after a copy (``tensor_import``). Speaking the wire protocol ourselves on a
plain TCP socket lets ``recv_into`` put each array's bytes straight into an aligned buffer
TensorFlow then owns: no copy beyond the kernel's. Producers are unchanged (their PUSH socket
sees an ordinary PULL peer). ZMTP 3.0 (rfc.zeromq.org/spec/23): a 64-byte greeting each way,
a READY command each way, then frames of ``flags, size, body``. This module is the connection: the
socket, its reads and bounded sends, frames and their limits; what the greeting and READY bytes mean
(and our own) is ``zmtp_wire.py``.

Only what a trainer needs: NULL mechanism (CurveZMQ stays with libzmq), one message at a
time, PING answered with PONG; as a DEALER (exact mode, facing a producer's ROUTER) it also
sends single-frame messages: ``send`` queues the frame and writes what the socket takes at
once, the rest whenever ``flush`` runs (each read that waits runs it), so a sender never
blocks. The queue is bounded: a peer that leaves queued bytes unread for ``stall_s``, or lets
more than ``MAX_UNSENT`` pile up, is dropped; a PING is not answered while bytes wait (a peer
flooding PINGs and reading nothing queues nothing). Every size is checked before anything is read into memory; a
violation raises ``ProtocolError`` naming it. After one, ``in_sync`` says whether the stream
can go on (the rest of a bad message was skipped) or the connection must be dropped.
``should_stop()`` is asked on every read and at least every ``poll_s`` while one waits, also
while bytes keep coming; a stop raises ``Stopped``. Connecting and the handshake together
take at most ``connect_timeout`` (then OSError or ProtocolError naming the endpoint). Once a
message has begun, a peer that sends nothing for ``stall_s`` seconds is dropped
(ConnectionError); between messages idling and heartbeats (PING, answered with PONG) are
legal for any length of time. ``skip`` bounds both the bytes and the frames it reads past.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Callable, Optional, TypeVar

from stoker.protocol.errors import ProtocolError

from stoker.consumer.receive.stream_address import (CONNECTING, StreamAddress, connect_failure, open_stream,
                                                    stream_address, tune_stream)
from stoker.consumer.transport.zmtp_reader import FrameReader, Steps, handshake_steps
from stoker.consumer.transport.zmtp_wire import PEER_TYPE, SocketTypeMismatch, encode_frame

__all__ = ["MAX_UNSENT", "PEER_TYPE", "STALL_S", "SocketTypeMismatch", "Stopped", "ZMTPConnection"]
#: Seconds a peer may go without sending a byte once a message has begun (libzmq drops a peer after
#: its heartbeat timeout; a live peer stalled mid-frame would otherwise hold its receive thread forever).
#: Between messages a producer may be idle, or send nothing but heartbeats, for as long as it likes.
STALL_S = 30.0
T = TypeVar("T")
#: Bytes a DEALER's sends may queue while the peer reads nothing: the largest control message (a hello with a
#: long run's input state) fits; past it the peer is dropped.
MAX_UNSENT = 256 * 1024 * 1024


class Stopped(Exception):
    """``should_stop()`` said so while a read waited."""


class ZMTPConnection:
    """One connected, handshaken ZMTP 3 stream; see the module doc. ``socket_type``: ``"PULL"`` (facing a
    producer's PUSH) or ``"DEALER"`` (facing an exact-mode producer's ROUTER)."""

    def __init__(self, endpoint: str, should_stop: Callable[[], bool], poll_s: float = 0.1,
                 connect_timeout: float = 2.0, stall_s: float = STALL_S, socket_type: str = "PULL") -> None:
        if socket_type not in PEER_TYPE:
            raise ValueError(f"socket_type {socket_type!r}: one of {sorted(PEER_TYPE)}")
        self.endpoint = endpoint
        self.socket_type = socket_type
        self._out = bytearray()  # frames queued by send(), not yet taken by the socket
        self._out_since = 0.0  # when the oldest of them was queued
        self._out_lock = threading.Lock()
        self._closed = False
        self._should_stop = should_stop
        self._poll_s = poll_s
        self._stall_s = stall_s
        self.reader = FrameReader(self._pong)  # the parser: frames as steps this connection drives
        self._deadline: Optional[float] = time.monotonic() + connect_timeout  # until the handshake is done
        self._sock = self._connect(stream_address(endpoint))
        try:
            tune_stream(self._sock)
            self._sock.settimeout(poll_s)
            self._handshake()
            self._deadline = None
        except BaseException:
            self._sock.close()
            raise

    def _connect(self, where: StreamAddress) -> socket.socket:
        """A connected socket, waiting in ``poll_s`` steps (stop, deadline) instead of one blocking connect."""
        sock, address = open_stream(where)
        try:
            error = sock.connect_ex(address)
            failure = connect_failure(sock, error, self.endpoint)
            if failure is not None:
                raise failure
            while error in CONNECTING:
                if self._should_stop():
                    raise Stopped()
                assert self._deadline is not None
                if time.monotonic() > self._deadline:
                    raise TimeoutError(f"connecting to {self.endpoint} took too long")
                # poll, not select: select fails for descriptors past 1024, common in training processes
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
                if poller.poll(int(self._poll_s * 1000)):
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise OSError(error, os.strerror(error))
            return sock
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        with self._out_lock:  # never while another thread writes: the descriptor could be reused under it
            self._closed = True
            self._sock.close()

    def shutdown(self) -> None:
        """End the connection from another thread: a read waiting on it returns at once (ConnectionError)."""
        with self._out_lock:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already

    # ---- sending (DEALER) ------------------------------------------------------------------------

    def send(self, frame: bytes) -> None:
        """Queue ``frame`` as a one-frame message and write what the socket takes now (never waits).

        OSError once the connection is closed or stalled (the reader then drops it)."""
        self._queue(encode_frame(frame))

    def _pong(self, frame: bytes) -> None:
        if not self._out:  # a peer that reads nothing gets no more than one
            self._queue(frame)

    def _queue(self, data: bytes) -> None:
        with self._out_lock:
            if len(self._out) + len(data) > MAX_UNSENT:
                self._drop(f"{self.endpoint} left {len(self._out)} queued bytes unread")
            self._write(data)

    def flush(self) -> None:
        """Write what the socket takes of the queued frames (never waits); OSError as ``send``."""
        if self._out:
            with self._out_lock:
                self._write()

    @property
    def unsent(self) -> int:
        """Bytes queued by ``send`` that the socket has not taken yet."""
        return len(self._out)

    def _write(self, data: bytes = b"") -> None:
        """Caller holds ``_out_lock``: queue ``data`` behind what waits, write what the socket takes. Poll for room
        first: the socket's timeout would make ``send`` wait."""
        if self._closed:  # by the reader, while another thread held on to this connection
            raise ConnectionError(f"the connection to {self.endpoint} is closed")
        if data:
            if not self._out:
                self._out_since = time.monotonic()
            self._out += data
        poller = select.poll()
        poller.register(self._sock, select.POLLOUT)
        while self._out and poller.poll(0):
            sent = self._sock.send(self._out)
            del self._out[:sent]
        if not self._out:
            return
        if time.monotonic() - self._out_since > self._stall_s:  # the clock starts again only once all went out
            self._drop(f"{self.endpoint} left queued bytes unread for {self._stall_s:g} s")

    def _drop(self, why: str) -> None:
        """Caller holds ``_out_lock``: end the connection (the reader sees it end and connects again)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise ConnectionError(f"{why}: dropped")

    # ---- reading ---------------------------------------------------------------------------------

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` from the stream (waits; ConnectionError if the peer closes or stalls mid-message)."""
        progress_at = time.monotonic()
        while view.nbytes:
            if self._should_stop():
                raise Stopped()
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise ProtocolError(f"{self.endpoint} did not complete the ZMTP handshake in time: is it a Stoker "
                                    "producer?")
            try:
                got = self._sock.recv_into(view)
            except socket.timeout:
                self.flush()  # what send() could not write at once
                if self.in_message and time.monotonic() - progress_at > self._stall_s:
                    raise ConnectionError(f"{self.endpoint} sent nothing for {self._stall_s:g} s in the middle of a "
                                          "message: dropped (a stalled peer would hold its receive thread)") from None
                continue
            progress_at = time.monotonic()
            if not got:
                raise ConnectionError(f"{self.endpoint} closed the connection")
            view = view[got:]

    def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` (``zmtp_reader``) to their end with blocking reads; what they return. A failed read is
        thrown into the steps, which may say what it meant there."""
        try:
            view = next(steps)
            while True:
                try:
                    self.read_into(view)
                except ConnectionError as exc:
                    view = steps.throw(exc)
                    continue
                view = steps.send(None)
        except StopIteration as done:
            return done.value

    @property
    def in_sync(self) -> bool:
        return self.reader.in_sync

    @property
    def in_message(self) -> bool:
        return self.reader.in_message

    def _read(self, n: int) -> bytes:
        return self.drive(self.reader.read(n))

    def next_frame(self) -> tuple[bool, int]:
        """Head of the next message frame, answering PING and skipping other commands: (more, size).

        Heartbeats are legal traffic however long a producer idles: commands cost a bounded read
        each (at most ``MAX_COMMAND_BYTES``) and every read checks ``should_stop``.
        """
        return self.drive(self.reader.next_frame())

    def skip(self, size: int, more: bool, budget: int, frames: int, limit: int) -> None:
        """Read past the rest of a message (``FrameReader.skip``)."""
        self.drive(self.reader.skip(size, more, budget, frames, limit))

    def read_small(self, size: int, limit: int, what: str, more: bool, budget: int, frames: int,
                   message_limit: int) -> bytes:
        """A frame body of at most ``limit`` bytes (else skipped to the message's end, ProtocolError)."""
        return self.drive(self.reader.read_small(size, limit, what, more, budget, frames, message_limit))

    # ---- handshake -------------------------------------------------------------------------------

    def _handshake(self) -> None:
        """Greeting and READY each way (``zmtp_reader.handshake_steps``), bounded by the connect deadline."""
        self.drive(handshake_steps(self.reader, self.endpoint, self.socket_type, self._sock.sendall))
