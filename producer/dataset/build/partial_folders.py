"""A build's own partial folder, so a dataset is never seen half-built, also with several builders at once.

A build writes into ``OUT.partial-XXXXXXXX`` (``lock_new_partial``), holding an ``flock`` on ``building.lock``
inside it, and publishes by one ``rename`` to ``OUT`` (``publish_partial``): without ``overwrite`` that fails
rather than replace a dataset another process published meanwhile. A crash leaves its partial folder behind,
never an ``OUT`` that looks complete; the next build removes it (``remove_abandoned_partials``), and only those
whose builder is gone (the kernel drops the lock when a process dies), never one another process is writing.
``DatasetWriter`` (one LMDB) and ``ShardedWriter`` (shards and a manifest) both build this way.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import IO

from stoker.producer.dataset.sources.lmdb_format import DatasetError

_LOCK_NAME = "building.lock"


def lock_new_partial(out: Path) -> tuple[Path, IO[str]]:
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


def publish_partial(partial: Path, out: Path, overwrite: bool, lock: IO[str]) -> None:
    """Rename a finished build's ``partial`` folder to ``out`` (atomic), releasing its ``lock``. With ``overwrite``
    an existing ``out`` is replaced; without, DatasetError if another process published ``out`` meanwhile."""
    os.unlink(partial / _LOCK_NAME)  # still held through the open descriptor until close
    replaced = None
    if overwrite and out.exists():
        replaced = out.with_name(f"{out.name}.replaced-{secrets.token_hex(4)}")
        os.rename(out, replaced)
    try:
        os.rename(partial, out)  # atomic; refuses to replace a non-empty directory
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise DatasetError(f"{out} was published by another process while this build ran; "
                           "pass --overwrite to replace it") from None
    finally:
        lock.close()
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
