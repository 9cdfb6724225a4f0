"""A tar's ``SampleIndex`` kept in a file, so the processes that open the tar after the first do not walk its headers
again (~5.6 us a header: ~0.17 s for a tar of 10^4 three-member samples, the cost of ~37,000 sample reads).

Where the file is, is the shard source's choice (``sharded.ShardSource.index_file``): beside a cached copy
(``CACHE/shards/<sha256>/shard.index``, evicted with it) or, for a tar read in place, under the cache folder
(``tar-index/<sha256>.index``). It is keyed by the tar's SHA-256 from the manifest and also records the tar's size
and modification time, so a tar changed in place is never matched.

The format is ours, no pickle and no zip: a 96-byte header (``HEADER``: magic, version, the tar's size, mtime and
SHA-256, the counts, last a CRC-32 of everything else) then the arrays end to end, widest first so each is aligned:
offsets int64, sizes uint32, starts uint32, key_ends uint32, kinds uint16, extension lengths uint16, the keys' bytes,
the extensions' UTF-8 bytes. ``load_index`` is a parser: the file's size is bounded before it is read, the counts are
bounded by the tar (a member takes a 512-byte header at least) and must add up to the file's length exactly, and
every array is checked against the others and the tar before use (``IndexFileRefused`` says what was off: the
caller walks the tar again and overwrites the file). ``save_index`` writes a temporary name and renames it into
place: processes racing to write the same index leave one whole file.
"""

from __future__ import annotations

import os
import secrets
import struct
import zlib
from pathlib import Path

import numpy as np

from stoker.producer.dataset.sources.webdataset.headers import BLOCK, TarLimits
from stoker.producer.dataset.sources.webdataset.samples import MAX_EXTENSIONS, SampleIndex

MAGIC, VERSION = b"STKTIDX\0", 1
HEADER = struct.Struct("<8sIQq32sQQQIII")  # magic, version, tar size, tar mtime_ns, sha256, members, samples,
# key bytes, extensions, extension bytes, crc32 of the header before it and the payload
MAX_INDEX_BYTES = 512 << 20  # a larger file is refused unread (an index of 4 * 10^6 members is ~100 MB)


class IndexFileRefused(ValueError):
    """An index file that is not a whole, consistent index of this tar: it is ignored and rebuilt."""


def _payload_bytes(members: int, samples: int, key_bytes: int, extensions: int, extension_bytes: int) -> int:
    return members * (8 + 4 + 2) + (samples + 1) * 4 + samples * 4 + extensions * 2 + key_bytes + extension_bytes


def encode_index(index: SampleIndex, tar: os.stat_result, sha256: str) -> bytes:
    """The bytes of ``index``'s file for the tar with stat ``tar`` and SHA-256 ``sha256`` (hex); ValueError if an
    extension could not be read back (``load_index`` refuses names with NUL or ``/``)."""
    names = [e.encode() for e in index.extensions]
    if any(not n or b"\0" in n or b"/" in n or len(n) > TarLimits.name_bytes for n in names):
        raise ValueError("an extension name that an index file does not keep")
    arrays = [index.offsets.astype("<i8"), index.sizes.astype("<u4"), index.starts.astype("<u4"),
              index.key_ends.astype("<u4"), index.kinds.astype("<u2"), np.array([len(n) for n in names], "<u2")]
    payload = b"".join([a.tobytes() for a in arrays] + [bytes(index.keys), *names])
    head = HEADER.pack(MAGIC, VERSION, tar.st_size, tar.st_mtime_ns, bytes.fromhex(sha256), len(index.offsets),
                        len(index), len(index.keys), len(names), sum(map(len, names)), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


def save_index(path: Path, index: SampleIndex, tar: os.stat_result, sha256: str) -> None:
    """Write ``index`` to ``path`` atomically (a temporary name in its folder, renamed); the folder is never
    created (a cached shard's folder evicted meanwhile stays gone). OSError if it cannot be written, ValueError if
    the index cannot be kept (``encode_index``)."""
    data = encode_index(index, tar, sha256)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as out:
            out.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_index(path: Path, tar: os.stat_result, sha256: str, records: int,
               limits: TarLimits = TarLimits()) -> SampleIndex:
    """The index kept at ``path`` for the tar with stat ``tar``, SHA-256 ``sha256`` and ``records`` samples.
    FileNotFoundError if there is none; IndexFileRefused naming what is off if it is not this tar's whole index;
    another OSError if it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if not HEADER.size <= size <= MAX_INDEX_BYTES:
            raise IndexFileRefused(f"{size} bytes (an index is {HEADER.size} to {MAX_INDEX_BYTES})")
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size and (n := os.readv(fd, [view[got:]])):
            got += n
    finally:
        os.close(fd)
    if got != size:
        raise IndexFileRefused(f"read {got} of its {size} bytes (written meanwhile)")
    return parse_index(data, tar, sha256, records, limits)


def parse_index(data: bytes | bytearray, tar: os.stat_result, sha256: str, records: int,
                limits: TarLimits = TarLimits()) -> SampleIndex:
    """``load_index`` on bytes already read (their length bounded by the caller)."""
    if len(data) < HEADER.size:
        raise IndexFileRefused(f"{len(data)} bytes, shorter than its header")
    magic, version, tar_size, mtime_ns, digest, members, samples, key_bytes, n_ext, ext_bytes, crc = \
        HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise IndexFileRefused("not a Stoker tar index of this version")
    if (tar_size, mtime_ns, digest) != (tar.st_size, tar.st_mtime_ns, bytes.fromhex(sha256)):
        raise IndexFileRefused("it indexes another tar (size, time or SHA-256 differ)")
    most = min(limits.members, tar.st_size // BLOCK)
    if not (samples == records and samples <= members <= most and n_ext <= MAX_EXTENSIONS
            and key_bytes <= samples * limits.name_bytes and ext_bytes <= n_ext * limits.name_bytes):
        raise IndexFileRefused(f"counts out of bounds ({members} members, {samples} samples, the manifest says "
                               f"{records}; {key_bytes} key bytes, {n_ext} extensions)")
    if len(data) != HEADER.size + _payload_bytes(members, samples, key_bytes, n_ext, ext_bytes):
        raise IndexFileRefused(f"{len(data)} bytes, not what its counts make (cut short or padded)")
    if zlib.crc32(memoryview(data)[HEADER.size:], zlib.crc32(memoryview(data)[:HEADER.size - 4])) != crc:
        raise IndexFileRefused("its CRC-32 does not match (a damaged file)")
    at = HEADER.size

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal at
        array = np.frombuffer(data, dtype, count, at)
        at += array.nbytes
        return array
    offsets, sizes, starts = take("<i8", members), take("<u4", members), take("<u4", samples + 1)
    key_ends, kinds, ext_lens = take("<u4", samples), take("<u2", members), take("<u2", n_ext)
    keys, ext_blob = data[at:at + key_bytes], data[at + key_bytes:]
    _check_members(offsets, sizes, kinds, n_ext, tar.st_size, limits)
    _check_samples(starts, key_ends, members, key_bytes)
    extensions = _extensions(ext_lens, ext_blob)
    # views of ``data`` (little-endian: the native types on the hosts we run on; a big-endian one converts)
    return SampleIndex(offsets.astype(np.int64, copy=False), sizes.astype(np.uint32, copy=False),
                       kinds.astype(np.uint16, copy=False), starts.astype(np.uint32, copy=False),
                       key_ends.astype(np.uint32, copy=False), bytes(keys), extensions)


def _check_members(offsets: np.ndarray, sizes: np.ndarray, kinds: np.ndarray, n_ext: int, tar_size: int,
                   limits: TarLimits) -> None:
    """Each member's bytes follow a header, lie inside the tar, end before the next member's header, and are of a
    known extension."""
    if not len(offsets):
        return
    if offsets[0] < BLOCK or offsets[-1] > tar_size or int(sizes.max()) > limits.member_bytes:
        raise IndexFileRefused("a member's offset or size is outside the tar")
    ends = offsets + sizes.astype(np.int64)  # no overflow: offsets <= the tar's size, sizes < 2**32
    if int(ends[-1]) > tar_size or np.any(ends[:-1] + BLOCK > offsets[1:]):
        raise IndexFileRefused("members overlap or reach past the end of the tar")
    if int(kinds.max()) >= n_ext:
        raise IndexFileRefused("a member of an extension the index does not list")


def _check_samples(starts: np.ndarray, key_ends: np.ndarray, members: int, key_bytes: int) -> None:
    """Samples are runs of one or more members covering them all in order; keys are non-empty and cover the keys'
    bytes."""
    if starts[0] != 0 or starts[-1] != members or np.any(starts[1:] <= starts[:-1]):
        raise IndexFileRefused("samples' first members are not increasing from 0 to the member count")
    if len(key_ends) and (key_ends[0] == 0 or key_ends[-1] != key_bytes or np.any(key_ends[1:] <= key_ends[:-1])):
        raise IndexFileRefused("keys' ends are not increasing to the keys' length")


def _extensions(lengths: np.ndarray, blob: bytes | bytearray) -> tuple[str, ...]:
    if int(lengths.sum()) != len(blob) or (len(lengths) and int(lengths.min()) == 0):
        raise IndexFileRefused("extension names do not add up to their bytes")
    ends = np.cumsum(lengths)
    try:
        names = tuple(blob[int(e) - int(n):int(e)].decode() for e, n in zip(ends, lengths))
    except UnicodeDecodeError:
        raise IndexFileRefused("an extension name is not UTF-8") from None
    if any("\0" in n or "/" in n for n in names):
        raise IndexFileRefused("an extension name holds NUL or '/'")
    return names
