"""Writes a Stoker LMDB so that it is never seen half-built.

Records go into ``OUT.partial`` in batched transactions; the metadata record
is written last and the directory is renamed to ``OUT`` only after that commit.
A crash leaves ``OUT.partial`` behind (removed by the next build), never an
``OUT`` that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

import lmdb

from .dataset_format import META_KEY, DatasetError, DatasetMeta, encode_meta, encode_record, record_key

_INITIAL_MAP_SIZE = 1 << 30
_COMMIT_EVERY = 256


class DatasetWriter:
    """Append records with add(); finish(classes) publishes the dataset.

    Raises DatasetError if ``out`` exists and ``overwrite`` is false. Leaving the
    context without finish() (an exception) deletes the partial directory.
    """

    def __init__(self, out: str | os.PathLike, overwrite: bool = False) -> None:
        self.out = Path(out)
        if self.out.exists() and not overwrite:
            raise DatasetError(f"{self.out} already exists; pass --overwrite to replace it")
        self.partial = self.out.with_name(self.out.name + ".partial")
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)
        self._map_size = _INITIAL_MAP_SIZE
        self._env = lmdb.open(str(self.partial), map_size=self._map_size, subdir=True, lock=True)
        self._pending: list[tuple[bytes, bytes]] = []
        self.count = 0
        self._finished = False

    def add(self, label: int, image_bytes: bytes) -> int:
        """Queue one record; returns its index."""
        index = self.count
        self._pending.append((record_key(index), encode_record(label, image_bytes)))
        self.count += 1
        if len(self._pending) >= _COMMIT_EVERY:
            self._flush()
        return index

    def _put_all(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in items:
                        txn.put(key, value)
                return
            except lmdb.MapFullError:
                # The map is virtual address space, not disk: doubling is cheap.
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)

    def _flush(self) -> None:
        if self._pending:
            self._put_all(self._pending)
            self._pending = []

    def finish(self, classes: Sequence[str]) -> DatasetMeta:
        """Write the metadata record last, then rename the directory into place."""
        self._flush()
        meta = DatasetMeta(count=self.count, classes=tuple(classes))
        self._put_all([(META_KEY, encode_meta(meta))])
        self._env.sync(True)
        self._env.close()
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.partial, self.out)
        self._finished = True
        return meta

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if not self._finished:
            try:
                self._env.close()
            finally:
                shutil.rmtree(self.partial, ignore_errors=True)
