"""Writes a Stoker LMDB so that it is never seen half-built, also with several writers at once.

Records go into a directory of this build's own, ``OUT.partial-XXXXXXXX``, in
batched transactions; the metadata record is written last and the directory is
renamed to ``OUT`` only after that commit. A crash leaves its partial directory
behind, never an ``OUT`` that looks complete; the next build removes it.

Each build holds an ``flock`` on ``building.lock`` inside its partial directory,
so a build removes only partial directories whose builder is gone (the kernel
drops the lock when a process dies), never one another process is writing. The
publish is one ``rename``: without ``overwrite`` it fails rather than replace a
dataset another process published meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import IO, Sequence

import lmdb

from .dataset_format import META_KEY, DatasetError, DatasetMeta, encode_meta, encode_record, record_key

_INITIAL_MAP_SIZE = 1 << 30
_COMMIT_EVERY = 256
_LOCK_NAME = "building.lock"


def _lock_new_partial(out: Path) -> tuple[Path, IO[str]]:
    """A fresh partial directory for ``out`` and its held lock file."""
    while True:
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
        lock = open(partial / _LOCK_NAME, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.fstat(lock.fileno()).st_nlink:  # not removed by a cleaner between mkdtemp and flock
            return partial, lock
        lock.close()


def remove_abandoned_partials(out: Path) -> list[Path]:
    """Remove partial directories of ``out`` whose builder is gone; returns what was removed."""
    removed = []
    legacy = out.with_name(out.name + ".partial")  # from releases before per-build partial directories
    candidates = sorted(out.parent.glob(f"{out.name}.partial-*")) + ([legacy] if legacy.is_dir() else [])
    for partial in candidates:
        lock_path = partial / _LOCK_NAME
        try:
            lock = open(lock_path, "r")
        except FileNotFoundError:
            if partial == legacy:
                shutil.rmtree(partial, ignore_errors=True)
                removed.append(partial)
            continue  # being created right now (its lock file comes next), or not ours
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its builder is alive
            os.unlink(lock_path)  # a builder that locks this file next sees it unlinked and starts afresh
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
    return removed


class DatasetWriter:
    """Append records with add(); finish(classes) publishes the dataset.

    Raises DatasetError if ``out`` exists and ``overwrite`` is false, at construction or,
    if another process published ``out`` while this one wrote, at finish(). Leaving the
    context without finish() (an exception) deletes this build's partial directory.
    """

    def __init__(self, out: str | os.PathLike, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        if self.out.exists() and not overwrite:
            raise DatasetError(f"{self.out} already exists; pass --overwrite to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_partials(self.out)
        self.partial, self._lock = _lock_new_partial(self.out)
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
        self._publish()
        self._finished = True
        return meta

    def _publish(self) -> None:
        os.unlink(self.partial / _LOCK_NAME)  # still held through the open descriptor until close
        replaced = None
        if self.overwrite and self.out.exists():
            replaced = self.out.with_name(f"{self.out.name}.replaced-{secrets.token_hex(4)}")
            os.rename(self.out, replaced)
        try:
            os.rename(self.partial, self.out)  # atomic; refuses to replace a non-empty directory
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(self.partial, ignore_errors=True)
            raise DatasetError(f"{self.out} was published by another process while this build ran; "
                               "pass --overwrite to replace it") from None
        finally:
            self._lock.close()
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if not self._finished:
            try:
                self._env.close()
            finally:
                shutil.rmtree(self.partial, ignore_errors=True)
                self._lock.close()
