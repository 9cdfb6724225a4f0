"""A hand-written ZMTP 3 PUSH peer on loopback that a test makes misbehave on purpose.

It accepts the trainer's connection, completes the NULL handshake as a PUSH socket (or not,
if asked), then sends whatever bytes the test scripts: good batches, endless frames, PINGs,
half frames. Used by the hardening and fuzz tests of direct receive.
"""

from __future__ import annotations

import socket
import struct
from typing import Iterable, Optional

import numpy as np

from stoker.protocol import encode_batch

GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
BATCH = 4
SHAPE = (8, 8, 3)


def command(body: bytes) -> bytes:
    return (bytes([0x04, len(body)]) if len(body) < 256 else b"\x06" + struct.pack(">Q", len(body))) + body


def ready(socket_type: bytes = b"PUSH", raw_properties: Optional[bytes] = None) -> bytes:
    props = raw_properties if raw_properties is not None else (
        bytes([11]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type)
    return command(b"\x05READY" + props)


def frame(body: bytes, more: bool) -> bytes:
    flags = int(more)
    if len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def batch_frames(seq: int, value: int = 0) -> list[bytes]:
    """A valid batch whose images are all ``value`` and whose index says ``seq``."""
    arrays = {"images": np.full((BATCH, *SHAPE), value, np.uint8), "labels": np.arange(BATCH, dtype=np.int32),
              "index": np.arange(seq * BATCH, (seq + 1) * BATCH, dtype=np.int64), "epoch": np.zeros(BATCH, np.int32)}
    return [bytes(memoryview(f)) for f in encode_batch(arrays, producer="hostile", seq=seq)]


def message(frames: Iterable[bytes]) -> bytes:
    frames = list(frames)
    return b"".join(frame(f, i < len(frames) - 1) for i, f in enumerate(frames))


SPEC = {"images": ("uint8", [BATCH, *SHAPE]), "labels": ("int32", [BATCH])}


class HostilePeer:
    """Listens on 127.0.0.1; ``accept()`` returns a connected, handshaken socket (see the module doc)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(60)
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.accepted = 0

    def accept(self, greeting: bytes = GREETING, ready_command: Optional[bytes] = None) -> socket.socket:
        conn, _ = self.server.accept()
        self.accepted += 1
        conn.settimeout(60)
        conn.sendall(greeting)
        _read_exactly(conn, 64)  # the trainer's greeting
        conn.sendall(ready() if ready_command is None else ready_command)
        head = _read_exactly(conn, 2)  # the trainer's READY: a short command
        _read_exactly(conn, head[1])
        return conn

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> "HostilePeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the trainer closed the connection")
        data += chunk
    return data


def send_until_dropped(conn: socket.socket, chunk: bytes, max_bytes: int) -> int:
    """Send ``chunk`` over and over until the trainer drops the connection; bytes sent (max_bytes: gave up)."""
    sent = 0
    try:
        while sent < max_bytes:
            conn.sendall(chunk)
            sent += len(chunk)
    except OSError:
        return sent
    return max_bytes
