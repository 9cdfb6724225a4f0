"""A bounded walk over a tar's 512-byte headers: where each regular member's bytes are, never reading a body.

``TarWalk(source, where).members()`` yields ``(name, offset, size)`` for each regular member, in order. The walk
reads headers only: a member's body is passed over with a seek (a local file: ``FileBlocks``) or read through
without being kept (a stream: ``StreamBlocks``, which hashes every byte it passes). Nothing the tar says is
trusted: a header must pass its checksum; a size field must be octal digits (or GNU base-256, not negative) and,
for a local file, stay inside the file; extended headers (pax, GNU long name) before one member are read only
when together at most ``TarLimits.extended_bytes``. What the walk passes over is counted (``skipped``) and the first reasons kept
(``problems``): links, directories and devices (never followed), members over ``member_bytes`` or with names over
``name_bytes``, GNU sparse files. A header that cannot be read (checksum, garbled size, a body past the end) ends
the walk with ``ended`` saying why and where; the members yielded before it are whole. Beyond ``members`` headers
the walk ends too, so a tar of empty members cannot make a reader's index grow without bound.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from stoker.producer.dataset.sources.lmdb_format import MAX_RECORD_BYTES

BLOCK = 512
MAX_PROBLEMS = 20  # reasons kept per tar; every one is counted
_REGULAR = (b"0", b"\0", b"7")
_NO_BODY = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, fifos: tarfile skips no body for them
_ZEROS = bytes(BLOCK)
_EXTENDED = (b"x", b"g", b"L", b"K", b"X")


@dataclass(frozen=True)
class TarLimits:
    """What one tar may hold before the walk stops trusting it (defaults: a WebDataset shard's generous bounds)."""

    member_bytes: int = MAX_RECORD_BYTES  # a larger member is passed over and counted
    members: int = 4_000_000  # headers walked at most; then the walk ends, named
    name_bytes: int = 1024  # a longer member name is passed over and counted
    extended_bytes: int = 64 * 1024  # pax and GNU long-name headers' bodies before one member; more ends the walk


class FileBlocks:
    """A local tar read with ``pread``: headers read, bodies seeked over; ``size`` is the file's."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pos, self.size = fd, 0, os.fstat(fd).st_size

    def take(self, n: int) -> bytes:
        data = os.pread(self.fd, n, self.pos)
        self.pos += len(data)
        return data

    def skip_to(self, pos: int) -> bool:
        self.pos = min(pos, self.size)
        return pos <= self.size


class StreamBlocks:
    """A tar read once from a binary stream in ``chunk``-byte reads, every byte hashed (``sha256``) and counted
    (``pos`` once ``drain()`` ran: the object's size). Bodies are read through, never kept."""

    size: Optional[int] = None

    def __init__(self, stream: Any, chunk: int = 4 << 20) -> None:
        self.stream, self.chunk, self.sha256 = stream, chunk, hashlib.sha256()
        self._buf, self._at, self.pos = b"", 0, 0  # the chunk in hand, the next byte's place in it, in the stream

    def _fill(self) -> bool:
        data = self.stream.read(self.chunk)
        if not data:
            return False
        self.sha256.update(data)
        self._buf, self._at = data, 0
        return True

    def take(self, n: int) -> bytes:
        parts, want = [], n
        while want:
            if self._at >= len(self._buf) and not self._fill():
                break
            part = self._buf[self._at:self._at + want]
            self._at += len(part)
            want -= len(part)
            parts.append(part)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.pos += len(data)
        return data

    def skip_to(self, pos: int) -> bool:
        while pos > self.pos:
            if self._at >= len(self._buf) and not self._fill():
                return False
            step = min(pos - self.pos, len(self._buf) - self._at)
            self._at += step
            self.pos += step
        return True

    def drain(self) -> None:
        """Read (and hash) whatever is left after the walk: the tar's end blocks and padding."""
        self.pos += len(self._buf) - self._at
        self._buf, self._at = b"", 0
        while self._fill():
            self.pos += len(self._buf)
            self._at = len(self._buf)


def _number(field: bytes) -> int:
    """A header's numeric field: octal digits (NUL/space padded) or GNU base-256; ValueError if garbled."""
    if field[:1] and field[0] & 0x80:
        if field[0] != 0x80:  # 0xff: negative; other high values are not a size
            raise ValueError(f"base-256 field {field.hex()} is negative or garbled")
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if digits.strip(b"01234567"):
        raise ValueError(f"field {field!r} is not octal")
    return int(digits, 8) if digits else 0


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[148:156])
    except ValueError:
        return False
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32  # the checksum field counts as eight spaces
    if stored == unsigned:
        return True
    blanked = block[:148] + b" " * 8 + block[156:]  # some old tars summed signed chars
    return stored == unsigned - 256 * sum(1 for b in blanked if b > 127)


def _pax(body: bytes) -> dict[bytes, bytes]:
    """A pax header's records ``LEN key=value\\n``; ValueError if one does not parse (bounded: body is)."""
    records, at = {}, 0
    while at < len(body) and body[at:at + 1] != b"\0":
        space = body.find(b" ", at, at + 20)
        if space < 0 or not body[at:space].isdigit():
            raise ValueError(f"pax record at {at} has no length")
        end = at + int(body[at:space])
        key, eq, value = body[space + 1:end].partition(b"=")
        if end > len(body) or end <= space or not eq or body[end - 1:end] != b"\n":
            raise ValueError(f"pax record at {at} is malformed")
        records[key] = value[:-1]
        at = end
    return records


class TarWalk:
    """One walk over one tar's headers (module doc). ``skipped``, ``problems`` and ``ended`` tell what it passed
    over and why it stopped early ("" for a clean end); ``cut`` names the member the tar's end cut, if one."""

    def __init__(self, source: FileBlocks | StreamBlocks, where: str, limits: TarLimits = TarLimits()) -> None:
        self.source, self.where, self.limits = source, where, limits
        self.skipped, self.problems, self.ended = 0, [], ""
        self.cut: bytes = b""  # the member whose bytes the tar cut short, if one did (samples.SampleBuilder.finish)

    def skip(self, name: bytes, why: str) -> None:
        """Count a member passed over (the sample grouping calls it too)."""
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{self.where}: member {name[:200].decode(errors='replace')!r}: {why}")

    def _end(self, at: int, why: str) -> None:
        self.ended = f"{self.where}: the tar is unreadable from byte {at} on: {why}"

    def members(self) -> Iterator[tuple[bytes, int, int]]:
        """``(name, offset of its bytes, size)`` of each regular member within the limits, in tar order."""
        src, limits, pending, headers = self.source, self.limits, {}, 0
        extended = 0  # bytes of the extended headers since the last member: all of them bound what pending holds
        while True:
            at = src.pos
            block = src.take(BLOCK)
            if len(block) < BLOCK:
                if block:
                    self._end(at, "a header cut short (a truncated tar)")
                return
            if block == _ZEROS:
                return  # the end-of-archive block
            headers += 1
            if headers > limits.members:
                return self._end(at, f"more than {limits.members} members")
            if not _checksum_ok(block):
                return self._end(at, "a header whose checksum does not match (not a tar, or corrupt)")
            kind = block[156:157]
            try:
                size = _number(block[124:136])
                if b"size" in pending and kind not in _EXTENDED:
                    size = int(pending[b"size"]) if pending[b"size"].isdigit() else -1
            except ValueError as exc:
                return self._end(at, f"a header's size: {exc}")
            name = b"" if kind in _EXTENDED else pending.get(b"path") or self._ustar_name(block)
            body = 0 if kind in _NO_BODY else size
            if body < 0 or (src.size is not None and src.pos + body > src.size):
                self.cut = name
                return self._end(at, f"a member of {size} bytes reaching past the end of the file (truncated tar, or "
                                 "a size that lies)")
            body_at = src.pos
            if kind in _EXTENDED:
                extended += size
                if extended > limits.extended_bytes:  # one header, or a run of them before one member
                    return self._end(at, f"extended headers of {extended} bytes before one member (at most "
                                     f"{limits.extended_bytes})")
                body = src.take(size)
                if len(body) < size:
                    return self._end(at, "an extended header cut short")
                try:
                    if kind in (b"x", b"X"):
                        pending.update(_pax(body))
                    elif kind == b"L":
                        pending[b"path"] = body.split(b"\0", 1)[0]
                except ValueError as exc:
                    return self._end(at, f"an extended header: {exc}")
                if not src.skip_to(body_at + -(-size // BLOCK) * BLOCK):
                    return self._end(at, "an extended header cut short")
                continue
            sparse = any(key.startswith(b"GNU.sparse.") for key in pending)
            pending, extended = {}, 0
            if kind in _NO_BODY or (kind not in _REGULAR) or sparse or name.endswith(b"/"):
                self.skip(name, "not a regular file (a link, folder, device or sparse file: never followed)")
            elif size > limits.member_bytes:
                self.skip(name, f"{size} bytes, more than {limits.member_bytes}")
            elif len(name) > limits.name_bytes:
                self.skip(name, f"a name of {len(name)} bytes, more than {limits.name_bytes}")
            else:
                yield name, body_at, size
            if not src.skip_to(body_at + -(-body // BLOCK) * BLOCK):
                self.cut = name
                return self._end(at, f"member {name[:200].decode(errors='replace')!r} cut short (a truncated tar)")

    @staticmethod
    def _ustar_name(block: bytes) -> bytes:
        name = block[:100].split(b"\0", 1)[0]
        if block[257:263] == b"ustar\0":  # POSIX: a prefix folder may hold the name's start
            prefix = block[345:500].split(b"\0", 1)[0]
            if prefix:
                return prefix + b"/" + name
        return name
