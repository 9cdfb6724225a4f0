"""The reading side of the dataset wing: where a dataset is opened (``open_dataset``, the one place) and the sources
it opens. One module per job:

- ``lmdb_format``: what a Stoker LMDB is (names, limits, field kinds, the metadata record, record keys);
  ``record_codec``: how a record's values are stored and checked; ``lmdb_dataset``: ``LmdbDataset``, opening an
  LMDB (its checks) and reading its records;
- ``manifest``: a sharded dataset's manifest and its checks; ``sharded``: ``ShardedDataset``, its shards read as
  one dataset from wherever a ``ShardSource`` makes them local;
- ``object_storage``: a sharded dataset at a URL (``open_remote``, ``RemoteOptions``), read through ``shard_cache``
  (the bounded local cache), whose every storage call goes through ``storage_retry``.

What writes datasets is ``stoker.producer.dataset.build``; it imports this side, never the reverse.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from stoker.producer.dataset.sources.lmdb_dataset import LmdbDataset
from stoker.producer.dataset.sources.lmdb_format import DatasetError, RecordError, record_key
from stoker.producer.dataset.sources.manifest import MANIFEST, parse_manifest
from stoker.producer.dataset.sources.object_storage import RemoteOptions, open_remote
from stoker.producer.dataset.sources.sharded import LocalShards, ShardedDataset

__all__ = ["open_dataset", "is_url", "RemoteOptions", "LmdbDataset", "ShardedDataset", "DatasetError", "RecordError",
           "record_key"]


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names object storage (``s3://``, ``gs://``, ``file://``: any fsspec URL)."""
    return "://" in str(location)


def open_dataset(location: str | os.PathLike, remote: Optional[RemoteOptions] = None,
                 cancel: Optional[threading.Event] = None) -> "LmdbDataset | ShardedDataset":
    """A dataset at a path (one LMDB, or a sharded dataset's folder) or a URL (a sharded dataset in object
    storage, reached with ``remote``; ``cancel``, once set, ends its waits on storage: ``object_storage.open_remote``).
    DatasetError naming what is wrong."""
    if is_url(location):
        return open_remote(str(location), cancel=cancel, **(remote or RemoteOptions()).open_kwargs())
    path = Path(location)
    if (path / MANIFEST).is_file():
        data = remote.manifest if remote is not None and remote.manifest else (path / MANIFEST).read_bytes()
        return ShardedDataset(parse_manifest(data, str(path / MANIFEST)), LocalShards(path), str(path), data)
    return LmdbDataset(path)
