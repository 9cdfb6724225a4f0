"""The trainer's ZMTP 3 reading as resumable steps, without a socket: the one parser both receive paths drive.

Each step is a generator that yields a ``memoryview`` it needs filled and is resumed (``send(None)``) once
that view is full; its return value is what it read. A blocking connection (``zmtp.ZMTPConnection``, one
thread per producer) fills each view with blocking reads; a selector loop (``connection_loop``, many
connections per thread) fills it as bytes arrive on a non-blocking socket, so a slow peer holds no thread.
A read that fails is thrown into the step (``generator.throw``), so a step says what a hang-up meant where
it happened (at the greeting: a CurveZMQ producer; at READY: a producer of the other mode). Array bodies
are yielded as views of the caller's memory (no copy beyond the kernel's).

Every size is checked before anything is read into memory; a violation raises ``ProtocolError`` naming it.
After one, ``in_sync`` says whether the stream can go on (the rest of a bad message was skipped) or the
connection must be dropped. ``in_message`` is True while a message has begun (silence past the stall
limit then drops the peer; between messages idling and heartbeats are legal for any length of time).
PING is answered through ``pong`` (the connection decides whether it may queue one).
"""

from __future__ import annotations

import struct
from typing import Callable, Generator, Optional, TypeVar

from stoker.protocol.errors import ProtocolError

from stoker.consumer.receive.errors import ADVICE_HUNG_UP
from stoker.consumer.transport.zmtp_wire import (COMMAND, GREETING, LONG, MAX_COMMAND_BYTES, MORE,
                                                 SocketTypeMismatch, check_greeting, check_ready, encode_frame,
                                                 mismatch_advice, ready_command)

__all__ = ["FrameReader", "Steps", "handshake_steps"]

T = TypeVar("T")
#: a step: yields views to fill, returns what it read
Steps = Generator[memoryview, None, T]


class FrameReader:
    """Frames of one ZMTP stream as steps (see the module doc). ``pong(frame)``: queue this PONG command frame."""

    def __init__(self, pong: Callable[[bytes], None]) -> None:
        self._pong = pong
        self.in_message = False  # a message has begun: silence past the stall limit drops the peer
        self.in_sync = True
        self._more = False  # the last message frame had MORE set
        self._scratch: Optional[memoryview] = None

    @staticmethod
    def fill(view: memoryview) -> Steps[None]:
        """Fill ``view`` (memory the caller owns: an array's bytes land there directly)."""
        if view.nbytes:
            yield view

    def read(self, n: int) -> Steps[bytes]:
        data = bytearray(n)
        yield from self.fill(memoryview(data))
        return bytes(data)

    def frame_head(self) -> Steps[tuple[int, int]]:
        flags = (yield from self.read(1))[0]
        if flags & ~(MORE | LONG | COMMAND):
            self.in_sync = False
            raise ProtocolError(f"frame flags {flags:#04x} have reserved bits set: not a ZMTP 3 stream")
        size = struct.unpack(">Q", (yield from self.read(8)))[0] if flags & LONG else (yield from self.read(1))[0]
        return flags, size

    def next_frame(self) -> Steps[tuple[bool, int]]:
        """Head of the next message frame, answering PING and skipping other commands: (more, size).

        Heartbeats are legal traffic however long a producer idles: commands cost a bounded read
        each (at most ``MAX_COMMAND_BYTES``).
        """
        self.in_message = self._more  # waiting for a frame head is idling only between messages
        while True:
            flags, size = yield from self.frame_head()
            if not flags & COMMAND:
                self._more = bool(flags & MORE)
                self.in_message = True  # its body follows
                return self._more, size
            if size > MAX_COMMAND_BYTES:
                self.in_sync = False
                raise ProtocolError(f"a {size}-byte command frame: more than the {MAX_COMMAND_BYTES} allowed")
            body = yield from self.read(size)
            if body[:5] == b"\x04PING":
                context = body[7:7 + 16]  # after the 2-byte TTL, at most 16 bytes of context
                self._pong(encode_frame(b"\x04PONG" + context, command=True))

    def skip(self, size: int, more: bool, budget: int, frames: int, limit: int) -> Steps[None]:
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
                yield from self.fill(scratch[:n])
                size -= n
            if not more:
                return
            if frames <= 0:
                self.in_sync = False
                raise ProtocolError("a message with more frames than a batch may have: the peer never ends it")
            frames -= 1
            more, size = yield from self.next_frame()

    def read_small(self, size: int, limit: int, what: str, more: bool, budget: int, frames: int,
                   message_limit: int) -> Steps[bytes]:
        """A frame body of at most ``limit`` bytes (else skipped to the message's end, ProtocolError)."""
        if size > limit:
            yield from self.skip(size, more, budget, frames, message_limit)
            raise ProtocolError(f"{what} is {size} bytes, more than the {limit} allowed")
        return (yield from self.read(size))


def handshake_steps(reader: FrameReader, endpoint: str, socket_type: str, send: Callable[[bytes], None]) -> Steps[None]:
    """Greeting and READY each way (``zmtp_wire`` judges the peer's bytes); ``send`` writes ours. ProtocolError
    (SocketTypeMismatch for a producer of the other mode) naming what was wrong."""
    send(GREETING)
    try:
        peer = yield from reader.read(64)
    except ConnectionError:  # a CurveZMQ producer hangs up on a NULL greeting, often before sending its own
        raise ProtocolError(f"{endpoint} closed the connection during the ZMTP greeting: {ADVICE_HUNG_UP}") from None
    check_greeting(endpoint, peer)
    send(encode_frame(ready_command(socket_type), command=True))
    try:
        flags, size = yield from reader.frame_head()
    except ConnectionError:  # libzmq closes on a socket type it cannot talk to, often before its READY
        raise SocketTypeMismatch(f"{endpoint} closed the connection at the READY command: "
                                 f"{mismatch_advice(socket_type)}") from None
    if not flags & COMMAND or size > MAX_COMMAND_BYTES:
        raise ProtocolError(f"{endpoint} sent no READY command after its greeting")
    check_ready(endpoint, socket_type, (yield from reader.read(size)))
