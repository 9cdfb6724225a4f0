"""What every dataset a producer reads is: a ``RecordSource``. ``open_dataset`` (this package's door) gives one for
any location, and the daemon, its workers and ``stoker lmdb info`` read through it alone, never asking which kind.

Two implementations: ``LmdbDataset`` (one Stoker LMDB: no layout, nothing to fetch) and ``ShardedDataset`` (a
manifest and shards of any ``ShardFormat``: LMDB, WebDataset tars, Parquet; local or through a bounded cache).

- ``meta``: the dataset's ``DatasetMeta`` (count, fields and their kinds, classes); ``len()`` its record count;
  ``path``: where it was opened from (a path or URL), for messages.
- ``read(index)``: record ``index`` (global, 0 <= index < len) as a dict of the fields ``meta.fields`` names;
  ``RecordError`` naming what is wrong for a record that cannot be had (corrupt, its shard unavailable): the
  worker skips and counts it. Never anything else for bad bytes.
- ``layout``: the ``Manifest`` (shards, their record counts, the shard format), or None for one LMDB: what the
  epoch order's blocks follow (``serve/sharding.layout_block``) and ``stoker lmdb info`` describes;
  ``manifest_bytes``: the manifest as read (b"" without one; a worker's: the compact form it was handed), whose
  parsed layout the daemon pins its workers to (``Manifest.to_compact``).
- ``prefetch(number)``: a hint to fetch shard ``number`` ahead (a no-op where every shard is local);
  ``holdings()``: ``(capacity, held)``: how many shards this host's cache holds at most (None: all local) and
  which it holds now (an elastic pool hands splits by them). Neither reads a record.
- ``size_bytes()``: the dataset's bytes (every shard's, from the manifest); ``close()``; a context manager.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol
from urllib.parse import urlsplit, urlunsplit

from stoker.producer.dataset.sources.lmdb_format import DatasetMeta
from stoker.producer.dataset.sources.manifest import Manifest
from stoker.protocol.batch_header import MAX_SOURCE_CHARS


class RecordSource(Protocol):
    """A dataset read by global record index (module doc)."""

    meta: DatasetMeta
    manifest_bytes: bytes

    @property
    def path(self) -> Any: ...

    @property
    def layout(self) -> Optional[Manifest]: ...

    def __len__(self) -> int: ...

    def read(self, index: int) -> dict[str, Any]: ...

    def prefetch(self, number: int) -> None: ...

    def holdings(self) -> tuple[Optional[int], list[int]]: ...

    def size_bytes(self) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> "RecordSource": ...

    def __exit__(self, *exc: object) -> None: ...


#: what ``source_kind`` calls each shard format: the name users know the data by
_KIND_OF_FORMAT = {"lmdb": "lmdb-shards", "tar": "webdataset", "parquet": "parquet"}


def source_kind(source: RecordSource) -> str:
    """What a source is, for logs, status and metrics: ``lmdb`` (one LMDB), ``lmdb-shards``, ``webdataset`` or
    ``parquet``."""
    layout = source.layout
    return "lmdb" if layout is None else _KIND_OF_FORMAT.get(layout.shard_format, layout.shard_format)


def shown_location(location: str) -> str:
    """Where a source was opened from, safe to show (logs, the status file, metrics, batch headers): a URL without
    its user info (``https://user:token@host/x`` -> ``https://host/x``), query or fragment, where a credential or a
    signed token may be; a path as it is. A URL that does not parse shows its scheme alone."""
    if "://" not in location:
        return location
    try:
        parts = urlsplit(location)
        return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
    except ValueError:  # an unparsable URL may still hold a secret: show none of it
        return location.split("://", 1)[0] + "://(unparsable URL)"


def source_label(kind: str, location: str) -> str:
    """``"<kind> <location>"`` as batch headers carry it (``protocol.batch_header.SOURCE_RULE``): the location
    shown (``shown_location``), characters outside printable ASCII escaped (``\\xe9``), and one longer than
    ``MAX_SOURCE_CHARS`` cut in the middle (``...``), keeping its scheme and the file it ends in."""
    text = f"{kind} {shown_location(location)}".encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text) if not text.isprintable() else text
    if len(text) <= MAX_SOURCE_CHARS:
        return text
    keep = (MAX_SOURCE_CHARS - 3) // 2
    return f"{text[:keep]}...{text[len(text) - (MAX_SOURCE_CHARS - 3 - keep):]}"
