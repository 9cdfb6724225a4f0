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

import errno
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Optional

from stoker.protocol.errors import ProtocolError

from stoker.consumer.receive.errors import ADVICE_HUNG_UP
from stoker.consumer.receive.options import tcp_address
from stoker.consumer.transport.zmtp_wire import (COMMAND, GREETING, LONG, MAX_COMMAND_BYTES, MORE, PEER_TYPE,
                                                 SocketTypeMismatch, check_greeting, check_ready, encode_frame,
                                                 mismatch_advice, ready_command)

__all__ = ["MAX_UNSENT", "PEER_TYPE", "STALL_S", "SocketTypeMismatch", "Stopped", "ZMTPConnection"]
#: Seconds a peer may go without sending a byte once a message has begun (libzmq drops a peer after
#: its heartbeat timeout; a live peer stalled mid-frame would otherwise hold its receive thread forever).
#: Between messages a producer may be idle, or send nothing but heartbeats, for as long as it likes.
STALL_S = 30.0
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
        self.in_message = False  # a message has begun: silence past stall_s drops the peer
        self._more = False  # the last message frame had MORE set
        self.in_sync = True
        self._scratch: Optional[memoryview] = None
        self._deadline: Optional[float] = time.monotonic() + connect_timeout  # until the handshake is done
        self._sock = self._connect(*tcp_address(endpoint))
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # What libzmq's heartbeats do on the other path: a dead host or a cut link drops the
            # connection within ~8 s (then it is connected again), not a silent half-open socket.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    self._sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
            self._sock.settimeout(poll_s)
            self._handshake()
            self._deadline = None
        except BaseException:
            self._sock.close()
            raise

    def _connect(self, host: str, port: int) -> socket.socket:
        """A connected socket, waiting in ``poll_s`` steps (stop, deadline) instead of one blocking connect."""
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            error = sock.connect_ex(address)
            while error in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
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

    def _read(self, n: int) -> bytes:
        data = bytearray(n)
        self.read_into(memoryview(data))
        return bytes(data)

    def _frame_head(self) -> tuple[int, int]:
        flags = self._read(1)[0]
        if flags & ~(MORE | LONG | COMMAND):
            self.in_sync = False
            raise ProtocolError(f"frame flags {flags:#04x} have reserved bits set: not a ZMTP 3 stream")
        size = struct.unpack(">Q", self._read(8))[0] if flags & LONG else self._read(1)[0]
        return flags, size

    def next_frame(self) -> tuple[bool, int]:
        """Head of the next message frame, answering PING and skipping other commands: (more, size).

        Heartbeats are legal traffic however long a producer idles: commands cost a bounded read
        each (at most ``MAX_COMMAND_BYTES``) and every read checks ``should_stop``.
        """
        self.in_message = self._more  # waiting for a frame head is idling only between messages
        while True:
            flags, size = self._frame_head()
            if not flags & COMMAND:
                self._more = bool(flags & MORE)
                self.in_message = True  # its body follows
                return self._more, size
            if size > MAX_COMMAND_BYTES:
                self.in_sync = False
                raise ProtocolError(f"a {size}-byte command frame: more than the {MAX_COMMAND_BYTES} allowed")
            body = self._read(size)
            if body[:5] == b"\x04PING":
                context = body[7:7 + 16]  # after the 2-byte TTL, at most 16 bytes of context
                pong = b"\x04PONG" + context
                if not self._out:  # a peer that reads nothing gets no more than one
                    self._queue(encode_frame(pong, command=True))

    def skip(self, size: int, more: bool, budget: int, frames: int, limit: int) -> None:
        """Read past the rest of a message (this frame's ``size`` bytes on).

        Out of sync (ProtocolError) past ``budget`` more bytes or ``frames`` more frames: a peer that
        never ends its message, even with empty frames, is dropped, not followed forever. ``limit``
        is the configured message size, for the error.
        """
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        scratch = self._scratch
        while True:
            if size > budget:
                self.in_sync = False
                raise ProtocolError(f"a message larger than the {limit} bytes allowed (max_message_bytes)")
            budget -= size
            while size:
                n = min(size, scratch.nbytes)
                self.read_into(scratch[:n])
                size -= n
            if not more:
                return
            if frames <= 0:
                self.in_sync = False
                raise ProtocolError("a message with more frames than a batch may have: the peer never ends it")
            frames -= 1
            more, size = self.next_frame()

    def read_small(self, size: int, limit: int, what: str, more: bool, budget: int, frames: int,
                   message_limit: int) -> bytes:
        """A frame body of at most ``limit`` bytes (else skipped to the message's end, ProtocolError)."""
        if size > limit:
            self.skip(size, more, budget, frames, message_limit)
            raise ProtocolError(f"{what} is {size} bytes, more than the {limit} allowed")
        return self._read(size)

    # ---- handshake -------------------------------------------------------------------------------

    def _handshake(self) -> None:
        """Greeting and READY each way (``zmtp_wire`` judges the peer's bytes), bounded by the connect deadline."""
        self._sock.sendall(GREETING)
        try:
            peer = self._read(64)
        except ConnectionError:  # a CurveZMQ producer hangs up on a NULL greeting, often before sending its own
            raise ProtocolError(f"{self.endpoint} closed the connection during the ZMTP greeting: "
                                f"{ADVICE_HUNG_UP}") from None
        check_greeting(self.endpoint, peer)
        self._sock.sendall(encode_frame(ready_command(self.socket_type), command=True))
        try:
            flags, size = self._frame_head()
        except ConnectionError:  # libzmq closes on a socket type it cannot talk to, often before its READY
            raise SocketTypeMismatch(f"{self.endpoint} closed the connection at the READY command: "
                                     f"{mismatch_advice(self.socket_type)}") from None
        if not flags & COMMAND or size > MAX_COMMAND_BYTES:
            raise ProtocolError(f"{self.endpoint} sent no READY command after its greeting")
        check_ready(self.endpoint, self.socket_type, self._read(size))
