"""The bytes of ZMTP 3.0 a trainer's end writes and checks, without a socket (rfc.zeromq.org/spec/23).

A 64-byte greeting each way (``GREETING``: version 3.0, the NULL mechanism), a READY command each way (ours
from ``ready_command``; the peer's checked by ``check_ready``), then frames of ``flags, size, body``
(``encode_frame``; the flag bits ``MORE``, ``LONG``, ``COMMAND``). ``zmtp.ZMTPConnection`` reads a stream and
hands these functions what it read; they decide what the bytes mean. Every length in a peer's bytes is
checked against what holds it before anything is sliced: a violation raises ``ProtocolError`` naming it
(``SocketTypeMismatch`` for a producer of the other mode), never an IndexError.
"""

from __future__ import annotations

import struct
from typing import Optional

from stoker.protocol.errors import ProtocolError

from stoker.consumer.receive.errors import ADVICE_PRODUCER_EXACT, ADVICE_PRODUCER_PLAIN

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
#: ours: signature, version 3.0, the NULL mechanism, as-server 0, filler
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
#: the largest command frame read (READY, PING); a larger one puts the stream out of sync
MAX_COMMAND_BYTES = 4096
#: What each socket type we speak must find at the other end: a producer's PUSH (plain) or ROUTER (exact mode).
PEER_TYPE = {"PULL": b"PUSH", "DEALER": b"ROUTER"}


class SocketTypeMismatch(ProtocolError):
    """The peer is a ZMTP socket of another type: one side runs exact mode and the other does not."""


def encode_frame(body: bytes, command: bool = False) -> bytes:
    """One last (no MORE) frame: flags, a 1-byte size or a LONG 8-byte one, the body."""
    flags = COMMAND if command else 0
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body


def check_greeting(endpoint: str, peer: bytes) -> None:
    """The peer's 64-byte greeting is ZMTP 3 or later with the NULL mechanism; else ProtocolError naming why."""
    if peer[0] != 0xFF or peer[9] != 0x7F:
        raise ProtocolError(f"{endpoint} does not speak ZMTP (greeting {peer[:10].hex()}): is it a Stoker "
                            "producer?")
    if peer[10] < 3:
        raise ProtocolError(f"{endpoint} speaks ZMTP {peer[10]}.{peer[11]}; direct receive needs 3.0 or later")
    mechanism = peer[12:32].rstrip(b"\0").decode("ascii", "replace")
    if mechanism != "NULL":
        raise ProtocolError(f"{endpoint} uses the {mechanism} mechanism (CurveZMQ): direct receive speaks "
                            "only NULL; give the trainer its curve keys and leave receive='libzmq'")


def ready_command(socket_type: str) -> bytes:
    """Our READY command's body for ``socket_type`` (``"PULL"`` or ``"DEALER"``)."""
    ready = b"\x05READY" + _property("Socket-Type", socket_type.encode())
    if socket_type == "DEALER":
        ready += _property("Identity", b"")  # as libzmq's DEALER sends it: the ROUTER picks our routing id
    return ready


def check_ready(endpoint: str, socket_type: str, body: bytes) -> None:
    """The peer's answer to our READY (a command's body) says it is a producer's socket for ``socket_type``:
    ProtocolError for an ERROR command or malformed metadata, SocketTypeMismatch (with the fix) for a producer
    of the other mode or another socket type."""
    if body[:6] == b"\x05ERROR":
        reason = body[7:7 + body[6]].decode("ascii", "replace") if len(body) > 6 else ""
        raise ProtocolError(f"{endpoint} refused the handshake: {reason}")
    peer_type = properties(body[6:]).get("Socket-Type") if body[:6] == b"\x05READY" else None
    if peer_type in PEER_TYPE.values() and peer_type != PEER_TYPE[socket_type]:
        raise SocketTypeMismatch(f"{endpoint} is a {peer_type.decode()} socket: {mismatch_advice(socket_type)}")
    if peer_type != PEER_TYPE[socket_type]:
        raise SocketTypeMismatch(f"{endpoint} is a {peer_type!r} socket, not a producer's "
                                 f"{PEER_TYPE[socket_type].decode()} socket")


def mismatch_advice(socket_type: str) -> str:
    """Why a producer refuses this trainer's socket type, and the fix (a DEALER is exact mode's)."""
    return ADVICE_PRODUCER_PLAIN if socket_type == "DEALER" else ADVICE_PRODUCER_EXACT


def _property(name: str, value: bytes) -> bytes:
    return bytes([len(name)]) + name.encode("ascii") + struct.pack(">I", len(value)) + value


def properties(data: bytes) -> dict[str, Optional[bytes]]:
    """READY metadata: name (1-byte length) and value (4-byte length) pairs, every length checked
    against what the command holds; ProtocolError for one that runs past its end."""
    out: dict[str, Optional[bytes]] = {}
    i = 0
    while i < len(data):
        n = data[i]
        if n == 0 or i + 1 + n + 4 > len(data):
            raise ProtocolError(f"READY property at byte {i} runs past the end of the command: not a ZMTP peer")
        name = data[i + 1:i + 1 + n].decode("ascii", "replace")
        i += 1 + n
        size = struct.unpack(">I", data[i:i + 4])[0]
        if i + 4 + size > len(data):
            raise ProtocolError(f"READY property {name!r} declares {size} bytes, the command holds "
                                f"{len(data) - i - 4}: not a ZMTP peer")
        out[name] = data[i + 4:i + 4 + size]
        i += 4 + size
    return out
