"""Sharded datasets in object storage: the manifest read through fsspec, shards fetched into a bounded local cache.

``open_remote("s3://bucket/prefix/")`` (any fsspec URL: ``s3://`` with s3fs, ``gs://`` with gcsfs, ``file://``)
reads the manifest (``prefix/manifest.json``; or a URL ending in ``.json``: an index anywhere) and returns a
``ShardedDataset`` whose shards a ``ShardCache`` makes local on first use. ``open_manifest`` opens what a manifest
read anywhere describes: its shards under its ``root`` (or beside it), through the cache when that is a URL, in
place when it is a path.

The cache itself (content-addressed, never a partial shard, bounded, one fetch per shard on a host, retried,
fetched ahead, counted) is ``shard_cache.py``; ``RemoteOptions`` is how ``stoker produce``'s flags reach it.

Credentials come from the storage library's standard chains (for s3fs: environment variables, ``~/.aws``
files, instance and pod roles); ``storage_options`` pass anything else (an endpoint). Nothing of them is logged.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from stoker.producer.dataset.sources.lmdb_format import DatasetError
from stoker.producer.dataset.sources.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from stoker.producer.dataset.sources.shard_cache import (DEFAULT_CACHE_BYTES, DEFAULT_RETRY_SECONDS, ShardCache,
                                                         default_cache_dir)
from stoker.producer.dataset.sources.shard_format import shard_format
from stoker.producer.dataset.sources.sharded import LocalShards, ShardedDataset, ShardUnavailable
from stoker.producer.dataset.sources.shard_table.compact import parse_compact
from stoker.producer.dataset.sources.storage_retry import StorageRefused, retried

S3_CONNECT_TIMEOUT_S, S3_READ_TIMEOUT_S = 10, 60  # one S3 call's bounds (``storage``)
TAR_INDEX_DIR = "tar-index"  # under the cache folder: the sample indexes of tars read in place


@dataclass(frozen=True)
class RemoteOptions:
    """How a producer reaches a dataset in object storage (``stoker produce``'s flags); plain data, so it crosses
    ``spawn`` to the workers. ``storage_options``: fsspec's, as text (``true``/``false`` become booleans)."""

    cache_dir: Optional[str] = None
    cache_bytes: Optional[int] = None
    storage_options: tuple[tuple[str, str], ...] = ()
    s3_endpoint: Optional[str] = None
    retry_seconds: float = 300.0
    #: the manifest as the daemon read it, in compact form (``Manifest.to_compact``), given to its workers: a dataset
    #: re-uploaded during a run never changes what a worker's record index means (None: read it)
    manifest: Optional[bytes] = None

    def fsspec_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in self.storage_options}
        if self.s3_endpoint:
            options.setdefault("client_kwargs", {})["endpoint_url"] = self.s3_endpoint
        return options

    def open_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"storage_options": self.fsspec_options(), "retry_seconds": self.retry_seconds,
                                  "manifest": self.manifest}
        if self.cache_dir:
            kwargs["cache_dir"] = self.cache_dir
        if self.cache_bytes:
            kwargs["cache_bytes"] = self.cache_bytes
        return kwargs


def storage(url: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """``(filesystem, root)`` for ``url``; DatasetError naming the package a scheme needs. An S3 client gets bounded
    connect and read timeouts unless ``storage_options`` set its ``config_kwargs`` (botocore waits 60 s by default,
    and retries: one call could hold a retry loop for minutes)."""
    try:
        import fsspec
    except ImportError:
        raise DatasetError(f"{url}: reading object storage needs fsspec: pip install 'stoker[s3]'") from None
    options = dict(storage_options or {})
    if url.split("://", 1)[0] in ("s3", "s3a"):
        options.setdefault("config_kwargs", {"connect_timeout": S3_CONNECT_TIMEOUT_S,
                                             "read_timeout": S3_READ_TIMEOUT_S})
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise DatasetError(f"{url}: {exc} (for s3:// install 'stoker[s3]'; gs:// needs gcsfs)") from None
    except ValueError as exc:
        raise DatasetError(f"{url}: {exc}") from None


def open_remote(url: str, cache_dir: Optional[os.PathLike] = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
                storage_options: Optional[dict[str, Any]] = None,
                retry_seconds: float = DEFAULT_RETRY_SECONDS, manifest: Optional[bytes] = None,
                cancel: Optional[threading.Event] = None) -> ShardedDataset:
    """The sharded dataset at ``url`` (a prefix holding ``manifest.json``, or an index: a URL ending in ``.json``),
    its manifest read now, or ``manifest`` (``Manifest.to_compact``'s bytes of it as read before); shards fetched on first use. DatasetError naming
    what is wrong with the URL, the credentials or the manifest, at once for an error that cannot heal;
    StorageCancelled once ``cancel`` is set (it also ends the shard cache's waits)."""
    where = url if url.endswith(".json") else f"{url.rstrip('/')}/{MANIFEST}"
    fs, path = storage(where, storage_options)

    def read_manifest() -> bytes:
        with fs.open(path, "rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    try:
        data = manifest or retried(f"reading {where}", read_manifest, retry_seconds, cancel)
    except StorageRefused as exc:
        if exc.verdict.reason == "the object does not exist":
            raise DatasetError(f"no sharded dataset at {url}: {exc} (upload one with `stoker lmdb upload`, or write "
                               "an index of tars or Parquet files with `stoker data index`)") from None
        raise DatasetError(f"cannot read the dataset at {url}: {exc}") from None
    except ShardUnavailable as exc:
        raise DatasetError(f"cannot read the dataset at {url}: {exc} (is --s3-endpoint right and the server up? "
                           "--fetch-retry-seconds sets how long it is waited for)") from None
    parsed = parse_compact(data, where) if manifest else parse_manifest(data, where)
    scheme = url.split("://", 1)[0]
    if parsed.root is not None and not parsed.root.startswith(f"{scheme}://"):
        # An index from storage names shards in storage of its own kind: never this host's files (read in place,
        # unchecked) nor another service reached with this producer's endpoint and credentials.
        raise DatasetError(f"the index at {where} names root {parsed.root!r}: an index read from {scheme}:// must keep "
                           f"its shards under {scheme}://; fix its root, or point --data at a local copy of the index")
    return open_manifest(parsed, data, url, where.rsplit("/", 1)[0], cache_dir, cache_bytes, storage_options,
                         retry_seconds, cancel)


def open_manifest(parsed: Manifest, data: bytes, location: str, beside: str, cache_dir: Optional[os.PathLike] = None,
                  cache_bytes: int = DEFAULT_CACHE_BYTES, storage_options: Optional[dict[str, Any]] = None,
                  retry_seconds: float = DEFAULT_RETRY_SECONDS,
                  cancel: Optional[threading.Event] = None) -> ShardedDataset:
    """The dataset manifest ``parsed`` (read as ``data`` from ``location``) describes: its shards under its ``root``,
    or under ``beside`` (the manifest's folder: a path or URL) without one; read in place from a path, through a
    ``ShardCache`` from a URL. DatasetError for a shard format not readable here or a budget below one shard."""
    root, fmt = parsed.root or beside, shard_format(parsed.shard_format)
    if "://" not in root:  # read in place; derived indexes (a tar's samples) are kept in the cache's folder
        index_dir = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / TAR_INDEX_DIR
        return ShardedDataset(parsed, LocalShards(Path(root), fmt, index_dir), location, data, fmt)
    fs, prefix = storage(root, storage_options)
    largest = parsed.shards[int(parsed.shards.bytes.argmax())]
    if largest.bytes > cache_bytes:
        raise DatasetError(f"the cache's budget ({cache_bytes} bytes) is smaller than shard {largest.name} of "
                           f"{location} ({largest.bytes} bytes): raise --cache-size to a few shards at least")
    cache = ShardCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), cache_bytes, fs, prefix, fmt,
                       retry_seconds, cancel)
    return ShardedDataset(parsed, cache, location, data, fmt)
