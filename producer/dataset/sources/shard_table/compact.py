"""The compact form of a parsed manifest: what a producer daemon hands its workers (``RemoteOptions.manifest``) so
none re-parses the JSON (10^6 tar shards: 145 MB of JSON, 4 s and ~800 MB a process; this form ~70 MB, ~0.1 s).

Layout (little-endian): ``MAGIC``, a uint32 header length, the header (JSON: the manifest's keys but ``shards``,
plus ``"shards": N``), then N int64 records, N int64 bytes, N x 32 SHA-256 bytes, N uint16 name lengths and the
names' ASCII. ``parse_compact`` trusts none of it: the header is bounded before it is read, the whole size is
computed from N (bounded by ``MAX_SHARDS``) and the lengths and must be exactly the data's, and the columns pass
the checks ``parse_manifest`` applies to the JSON (``columns.checked_table``, the same head and meta checks).
"""

from __future__ import annotations

import json
import struct

import numpy as np

from stoker.producer.dataset.sources.lmdb_format import DatasetError
from stoker.producer.dataset.sources.manifest import (FORMAT, MAX_MANIFEST_BYTES, MAX_SHARDS, VERSION, Manifest,
                                                      checked_head, checked_meta)
from stoker.producer.dataset.sources.shard_table.columns import checked_table
from stoker.producer.dataset.sources.shard_table.table import ShardTable

__all__ = ["MAGIC", "to_compact", "parse_compact"]

MAGIC = b"STOKER-MANIFEST-COMPACT-1\n"
MAX_HEADER = 16 * 1024 * 1024  # the meta (fields, classes, info): a manifest's JSON without its shards
_ROW = 8 + 8 + 32 + 2  # records, bytes, SHA-256, name length


def to_compact(manifest: Manifest) -> bytes:
    """``manifest`` as compact bytes (``parse_compact`` reads it back equal)."""
    head = {**manifest.head(), "shards": len(manifest.shards)}
    header = json.dumps(head).encode()
    table = manifest.shards
    lengths = np.diff(table.name_ends, prepend=0).astype("<u2")
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, table.records.astype("<i8").tobytes(),
                     table.bytes.astype("<i8").tobytes(), table.sha256.tobytes(), lengths.tobytes(), table.names])


def parse_compact(data: bytes, where: str) -> Manifest:
    """The manifest ``data`` (``to_compact``'s bytes) holds, checked as ``parse_manifest`` checks a manifest's JSON;
    DatasetError naming what is wrong (``where``: whence the bytes came)."""
    def bad(why: str) -> DatasetError:
        return DatasetError(f"{where}: not a compact Stoker manifest: {why}")

    view = memoryview(data)
    if len(view) > MAX_MANIFEST_BYTES or view[:len(MAGIC)] != MAGIC or len(view) < len(MAGIC) + 4:
        raise bad(f"no {MAGIC[:-1].decode()} header, or over {MAX_MANIFEST_BYTES} bytes")
    (header_len,) = struct.unpack_from("<I", view, len(MAGIC))
    at = len(MAGIC) + 4
    if header_len > min(MAX_HEADER, len(view) - at):
        raise bad(f"a header of {header_len} bytes in {len(view)}")
    try:
        body = json.loads(bytes(view[at:at + header_len]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"invalid header ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or "shards" not in body:
        raise bad(f"the header's 'format' is not {FORMAT!r}")
    shard_format, root = checked_head(body, bad)
    n = body["shards"]
    if type(n) is not int or not 1 <= n <= MAX_SHARDS:
        raise bad(f"'shards' must be 1-{MAX_SHARDS}")
    at += header_len
    if len(view) - at < n * _ROW:  # before any column is read
        raise bad(f"{len(view)} bytes cannot hold {n} shards")
    columns = []
    for dtype, width in (("<i8", 8), ("<i8", 8), ("u1", 32), ("<u2", 2)):
        columns.append(np.frombuffer(view, dtype, n * width // np.dtype(dtype).itemsize, at))
        at += n * width
    records, sizes, sha, lengths = columns
    if len(view) - at != int(lengths.sum(dtype=np.int64)):
        raise bad(f"the names' lengths add up to {int(lengths.sum(dtype=np.int64))}, not the {len(view) - at} "
                  "bytes left")
    table = ShardTable(bytes(view[at:]), np.cumsum(lengths, dtype=np.int64), records.astype(np.int64),
                       sizes.astype(np.int64), sha.copy())
    why = checked_table(table, shard_format)
    if why is not None:
        raise bad(why)
    return Manifest(checked_meta(body, body.get("count"), int(table.records.sum()), bad), table, shard_format,
                    root)
