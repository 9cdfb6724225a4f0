"""Opening a Stoker LMDB and reading its records: ``LmdbDataset``.

Opening checks the file before any record is read: ``data.mdb`` must exist, and be as long as the pages its LMDB
uses (past its end an mmap read is SIGBUS, which no Python handler catches), and its metadata must be a readable
version's (``lmdb_format.decode_meta``). Reading decodes and checks each record (``record_codec.decode_record``);
an LMDB error on a damaged page is that record's RecordError, never the process's end.

One LMDB is a whole ``RecordSource`` (``record_source.py``: no layout, nothing to fetch ahead) and the shard of a
sharded LMDB dataset: ``FORMAT`` is the ``ShardFormat`` (``shard_format.py``) of ``"shard_format": "lmdb"``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import lmdb

from stoker.producer.dataset.sources.lmdb_format import (META_KEY, DatasetError, DatasetMeta, RecordError, decode_meta,
                                                         record_key)
from stoker.producer.dataset.sources.record_codec import decode_record

if TYPE_CHECKING:
    from stoker.producer.dataset.sources.manifest import Manifest


def _read_meta(path: Path, env: lmdb.Environment) -> DatasetMeta:
    """The metadata, once the file is known whole (past its end an mmap read is SIGBUS); DatasetError if not."""
    needed, size = (env.info()["last_pgno"] + 1) * env.stat()["psize"], (path / "data.mdb").stat().st_size
    try:
        if size < needed:
            raise DatasetError(f"{path / 'data.mdb'} is truncated: {size} bytes, but its LMDB uses {needed} bytes "
                               "of pages; copy it again from the source (or rebuild it with `stoker lmdb build`)")
        with env.begin(buffers=False) as txn:
            return decode_meta(path, txn.get(META_KEY))
    except lmdb.Error as exc:
        raise DatasetError(f"cannot read the metadata of the LMDB at {path} ({type(exc).__name__}: {exc}): the file "
                           "is damaged; copy it again from the source (or rebuild it)") from None


class LmdbDataset:
    """Read-only access to a Stoker LMDB. Open one per process (LMDB handles do not survive fork).

    Raises DatasetError if the path is missing or not a Stoker dataset of a readable version.
    Use as a context manager or call close().
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            raise DatasetError(
                f"no LMDB at {self.path} (expected {self.path / 'data.mdb'}); "
                "create one with `stoker lmdb build SRC OUT` or `stoker lmdb synth OUT`"
            )
        try:
            self._env = lmdb.open(str(self.path), readonly=True, lock=False, readahead=False, meminit=False, max_readers=512)
        except lmdb.Error as exc:
            raise DatasetError(f"cannot open LMDB at {self.path}: {exc}") from None
        try:
            self.meta = _read_meta(self.path, self._env)
        except DatasetError:
            self._env.close()
            raise

    def __len__(self) -> int:
        return self.meta.count

    def read(self, index: int) -> dict[str, Any]:
        """Record ``index`` as a dict of its fields; RecordError if it is corrupt."""
        key = record_key(index)
        try:
            with self._env.begin(buffers=False) as txn:
                return decode_record(key, txn.get(key), self.meta)
        except lmdb.Error as exc:  # a damaged page (MDB_CORRUPTED, MDB_PAGE_NOTFOUND...): this record is lost
            raise RecordError(key, f"cannot be read from {self.path}: {type(exc).__name__}: {exc}") from None

    def iter_raw(self, indices: list[int]) -> Iterator[tuple[int, bytes | None]]:
        """Yield ``(index, raw value or None)`` in one read transaction, for batch reads."""
        with self._env.begin(buffers=False) as txn:
            for index in indices:
                yield index, txn.get(record_key(index))

    def size_bytes(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    #: one LMDB has no shard layout and nothing to fetch or pin (``record_source.RecordSource``)
    layout: Optional["Manifest"] = None
    manifest_bytes = b""

    def prefetch(self, number: int) -> None:
        """Nothing to fetch ahead: the file is local."""

    def holdings(self) -> tuple[Optional[int], list[int]]:
        """``(None, [])``: every record is on local disk."""
        return None, []

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> "LmdbDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LmdbShardFormat:
    """An LMDB shard (``shard_format.ShardFormat``): the object ``shard-NNNNN/data.mdb``, opened as an LmdbDataset
    of the folder holding it."""

    name = "lmdb"
    local_name = "data.mdb"

    def object_name(self, shard_name: str) -> str:
        return f"{shard_name}/{self.local_name}"

    def open(self, path: Path, info: Any, meta: DatasetMeta) -> LmdbDataset:
        """The LMDB whose ``data.mdb`` is ``path``; DatasetError if it is not a readable Stoker LMDB."""
        return LmdbDataset(path.parent)


FORMAT = LmdbShardFormat()
