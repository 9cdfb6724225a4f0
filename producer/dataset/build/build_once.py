"""A dataset built once and reused, safe when several processes ask for it at once.

``cached_dataset(path, build, usable)`` returns ``path`` after building it unless
``usable(path)`` already holds. Callers serialise on an ``flock`` of
``.NAME.lock`` beside the dataset: the first builds, the others wait (saying for
which process) and then find it usable. The kernel drops the lock of a process
that dies, so a crashed builder never blocks the next one. The wait is bounded.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable

from stoker.producer.dataset.sources.lmdb_format import DatasetError


def cached_dataset(path: str | os.PathLike, build: Callable[[Path], object], usable: Callable[[Path], bool],
                   wait_timeout: float = 3600.0, say: Callable[[str], None] = print) -> Path:
    """``path``, built by ``build(path)`` first unless ``usable(path)``; see the module doc.

    Raises DatasetError if another process holds the build longer than ``wait_timeout`` seconds.
    ``say`` receives the one "waiting for ..." message.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(f".{path.name}.lock")
    with open(lock_path, "a+") as lock:
        deadline, said = time.monotonic() + wait_timeout, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    lock.seek(0)
                    holder = lock.read().strip() or "another process"
                    say(f"waiting for {holder} building {path}")
                    said = True
                if time.monotonic() > deadline:
                    raise DatasetError(f"gave up after {wait_timeout:.0f} s waiting for another process building "
                                       f"{path} (lock {lock_path})") from None
                time.sleep(0.1)
        try:
            lock.truncate(0)
            lock.write(f"process {os.getpid()}")
            lock.flush()
            if not usable(path):
                build(path)
            return path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
