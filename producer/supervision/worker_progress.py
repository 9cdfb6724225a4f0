"""What each worker is doing, in shared memory: read by the daemon when a worker dies, to judge the death.

Each worker owns one row and is its only writer: whether it is ready (pipeline loaded, dataset open), the record
it is making (epoch, index; -1 between records), how many records it made or skipped since it started, and the
error that is about to end it, if Python saw one. A worker killed by a signal leaves its row as it was at that
moment, which is the point: the record that killed it is named there. The daemon writes the other part: the
records every worker skips without reading (``restart_policy``), appended index first, count last, so a
worker never reads an index that is not yet written.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Optional

_READY, _EPOCH, _INDEX, _MADE = range(4)
_WIDTH = 4
ERROR_BYTES = 400


class WorkerProgress:
    """Shared rows, one per worker, and the shared list of records to skip (at most ``capacity``)."""

    def __init__(self, workers: int, capacity: int, ctx: Any = None) -> None:
        ctx = ctx or mp.get_context("spawn")
        self.workers, self.capacity = workers, capacity
        self._rows = ctx.RawArray("q", workers * _WIDTH)
        self._errors = ctx.RawArray("c", workers * ERROR_BYTES)
        self._skip = ctx.RawArray("q", capacity + 1)  # [count, index, index, ...]
        self._known = 0  # this process's copy of the skip list: its length and contents
        self._skipped: set[int] = set()

    # ---- the worker's side -------------------------------------------------------------------

    def ready(self, worker: int) -> None:
        self._rows[worker * _WIDTH + _READY] = 1

    def making(self, worker: int, epoch: int, index: int) -> None:
        self._rows[worker * _WIDTH + _EPOCH] = epoch
        self._rows[worker * _WIDTH + _INDEX] = index

    def made(self, worker: int) -> None:
        row = worker * _WIDTH
        self._rows[row + _INDEX] = -1
        self._rows[row + _MADE] += 1

    def failing(self, worker: int, error: str) -> None:
        """The error about to end this worker (cut to ``ERROR_BYTES``), for the daemon's judgement and log."""
        data = error.encode("utf-8", "replace")[: ERROR_BYTES - 1].decode("utf-8", "ignore").encode()  # whole chars
        self._errors[worker * ERROR_BYTES: worker * ERROR_BYTES + len(data) + 1] = data + b"\0"

    def skips(self, index: int) -> bool:
        """Whether record ``index`` is to be skipped without reading (a shared count per call; the list is copied
        only when it grew)."""
        count = self._skip[0]
        if count != self._known:
            self._skipped = set(self._skip[1: count + 1])
            self._known = count
        return index in self._skipped

    # ---- the daemon's side -------------------------------------------------------------------

    def restarting(self, worker: int) -> None:
        """Clear ``worker``'s row before a new process takes it."""
        row = worker * _WIDTH
        self._rows[row: row + _WIDTH] = [0, -1, -1, 0]
        self._errors[worker * ERROR_BYTES] = b"\0"

    def of(self, worker: int) -> tuple[bool, Optional[tuple[int, int]], int, str]:
        """``(ready, (epoch, index) being made or None, records made, error)`` of ``worker``."""
        row = worker * _WIDTH
        ready, epoch, index, made = self._rows[row: row + _WIDTH]
        error = self._errors[worker * ERROR_BYTES: (worker + 1) * ERROR_BYTES].split(b"\0", 1)[0]
        return bool(ready), (epoch, index) if index >= 0 else None, made, error.decode("utf-8", "replace")

    def skip(self, index: int) -> None:
        """Every worker skips record ``index`` from its next record on. ValueError past ``capacity``."""
        count = self._skip[0]
        if count >= self.capacity:
            raise ValueError(f"the skip list holds {self.capacity} records at most")
        self._skip[count + 1] = index
        self._skip[0] = count + 1
