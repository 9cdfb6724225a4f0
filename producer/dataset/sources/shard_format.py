"""The door for a new kind of shard: what a sharded dataset needs of each shard format (LMDB, tar, Parquet).

A sharded dataset is a manifest (``manifest.py``: shards with record counts, sizes and SHA-256s, the fields and
classes) and its shards, each one object (a file, local or in object storage). ``ShardedDataset`` reads any of
them as one dataset with global record indices; only how one local shard file is opened and read differs, and that
is a ``ShardFormat``:

- ``name``: what the manifest's ``shard_format`` says (``lmdb``, ``tar``, ``parquet``);
- ``object_name(shard_name)``: the object a shard is, relative to the dataset's root (an LMDB shard is a folder
  ``shard-00003/data.mdb``; a tar or Parquet shard is its own file, ``000123.tar``);
- ``local_name``: the file name a cached copy gets in its cache folder (``data.mdb``, ``shard.tar``, ...);
- ``open(path, info, meta)``: a ``ShardReader`` over the local shard file at ``path`` (an LMDB shard: its
  ``data.mdb``); ``DatasetError`` if the file is not a shard of this format, ``OSError`` if it vanished meanwhile
  (an evicted cache entry: asked for again). A format whose reader derives an index from the shard (a tar's
  samples) says ``keeps_index = True`` and takes a fourth argument, ``index_file``: where its shard source lets it
  keep that index for the next process (``sharded.ShardSource.index_file``; None: nowhere).

Formats are found by name through one registry, ``shard_format(name)``: the module of each (``lmdb_dataset``,
``tar_shard``, ``parquet_shard``) is imported on first use, so a producer of LMDB never imports pyarrow, and a
missing optional package is a DatasetError naming the extra that brings it. A stateless format's module gives its
one ``FORMAT``; a format that keeps state for the shards it opens (Parquet's decoded row groups) gives a factory,
``make_format()``, called for each dataset opened, so that state belongs to the dataset and goes with it (the
house keeps no process-wide mutable state).

A ``ShardReader`` reads records by their index within the shard: ``read(i)`` gives a record, a dict of the
dataset's fields (``meta.fields``: name -> kind), or raises ``RecordError`` naming what is wrong (never anything
else for bad bytes: the worker skips and counts it, and the producer keeps serving). Reading is bounded in memory
and time whatever the file says (lengths are never trusted). ``len()`` is its record count; ``close()`` lets go of
the file.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta

#: shard format -> (the module under ``stoker.producer.dataset.sources`` giving it, the extra it needs)
FORMAT_MODULES = {"lmdb": ("lmdb_dataset", ""), "tar": ("tar_shard", ""), "parquet": ("parquet_shard", "parquet")}


class ShardReader(Protocol):
    """One local shard's records, by index within the shard (module doc)."""

    def __len__(self) -> int: ...

    def read(self, index: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ShardFormat(Protocol):
    """How one kind of shard is named and opened (module doc)."""

    name: str
    local_name: str

    def object_name(self, shard_name: str) -> str: ...

    def open(self, path: Path, info: Any, meta: DatasetMeta) -> ShardReader: ...


def shard_format(name: str) -> ShardFormat:
    """The ``ShardFormat`` a manifest's ``shard_format`` names, its module imported now: a fresh one from the
    module's ``make_format()`` where it has one (a format with state: one a dataset), else its ``FORMAT``.
    DatasetError for a name none of ``FORMAT_MODULES`` or a format whose package is missing (naming
    ``pip install 'stoker[EXTRA]'``)."""
    if name not in FORMAT_MODULES:
        raise DatasetError(f"no shard format {name[:40]!r}: this Stoker reads {', '.join(FORMAT_MODULES)}")
    module, extra = FORMAT_MODULES[name]
    package = __name__.rsplit(".", 1)[0]
    try:
        found = importlib.import_module(f"{package}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(package):
            raise DatasetError(f"this Stoker cannot read {name} shards (no {exc.name}): upgrade it") from None
        hint = f"pip install 'stoker[{extra}]'" if extra else f"pip install {exc.name}"
        raise DatasetError(f"reading {name} shards needs the package {exc.name!r}: {hint}") from None
    make = getattr(found, "make_format", None)
    return make() if make is not None else found.FORMAT  # type: ignore[no-any-return]
