"""The reading side of the dataset wing: where a dataset is opened (``open_dataset``, the one place) and the sources
it opens. One module per job:

- ``lmdb_format``: what a Stoker LMDB is (names, limits, field kinds, the metadata record, record keys);
  ``record_codec``: how a record's values are stored and checked; ``lmdb_dataset``: ``LmdbDataset``, opening an
  LMDB (its checks) and reading its records;
- ``record_source``: ``RecordSource``, what every opened dataset is (the daemon and its workers read nothing else);
- ``manifest``: a sharded dataset's manifest (or an index of data left where it lies) and its checks;
  ``sharded``: ``ShardedDataset``, its shards read as one dataset from wherever a ``ShardSource`` makes them local;
  ``shard_format``: ``ShardFormat``, how a shard of one format is named and opened, and the registry of formats
  (``shard_format(name)``: LMDB in ``lmdb_dataset``, ``tar_shard``, ``parquet_shard`` with its decoded row groups in
  the ``parquet`` sub-package);
- ``object_storage``: a sharded dataset at a URL (``open_remote``, ``RemoteOptions``), or under a manifest's root
  (``open_manifest``), read through ``shard_cache`` (the bounded local cache), whose every storage call goes
  through ``storage_retry``.

What writes datasets is ``stoker.producer.dataset.build``; it imports this side, never the reverse.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from stoker.producer.dataset.sources.lmdb_dataset import LmdbDataset
from stoker.producer.dataset.sources.lmdb_format import DatasetError, RecordError, record_key
from stoker.producer.dataset.sources.manifest import MANIFEST, MAX_MANIFEST_BYTES, parse_manifest
from stoker.producer.dataset.sources.object_storage import RemoteOptions, open_manifest, open_remote
from stoker.producer.dataset.sources.record_source import RecordSource
from stoker.producer.dataset.sources.sharded import ShardedDataset
from stoker.producer.dataset.sources.shard_table.compact import parse_compact

__all__ = ["open_dataset", "is_url", "RemoteOptions", "RecordSource", "LmdbDataset", "ShardedDataset", "DatasetError",
           "RecordError", "record_key"]


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names object storage (``s3://``, ``gs://``, ``file://``: any fsspec URL)."""
    return "://" in str(location)


def open_dataset(location: str | os.PathLike, remote: Optional[RemoteOptions] = None,
                 cancel: Optional[threading.Event] = None) -> RecordSource:
    """The dataset at ``location``: one LMDB's folder; a folder or URL holding ``manifest.json`` (a sharded
    dataset); or a path or URL ending in ``.json``, a manifest (an index of tars or Parquet files, whose ``root``
    says where they are). Object storage is reached with ``remote`` (``cancel``, once set, ends its waits:
    ``object_storage.open_remote``); ``remote.manifest``, where set, is the manifest as read before, in compact form
    (``Manifest.to_compact``: a producer's workers get it from the daemon).
    DatasetError naming what is wrong."""
    options = remote or RemoteOptions()
    if is_url(location):
        return open_remote(str(location), cancel=cancel, **options.open_kwargs())
    path = Path(location)
    manifest = path if path.suffix == ".json" else path / MANIFEST
    if not manifest.is_file() and not options.manifest:
        if path.suffix == ".json":
            raise DatasetError(f"no manifest at {path}: write an index with `stoker data index`, or name a dataset's "
                               "folder")
        return LmdbDataset(path)
    data = options.manifest
    if data:
        parsed = parse_compact(data, f"the manifest of {manifest} handed over")
    else:
        with open(manifest, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)  # parse_manifest names a larger one
        parsed = parse_manifest(data, str(manifest))
    kwargs = {k: v for k, v in options.open_kwargs().items() if k != "manifest"}
    return open_manifest(parsed, data, str(path), str(manifest.parent), cancel=cancel, **kwargs)
