"""Per-worker counters and stage timings shared with the daemon's main process.

Each worker owns one row of a lock-free shared array and is its only writer;
the main process only reads, so no lock is needed and a torn read can at worst
be off by one update in a log line. Beside it each worker has a short text: the
error it waits on object storage for ("" when it does not), which the daemon's
status to trainers and its metrics quote (``StorageWatch`` writes it).
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

FIELDS = ("batches", "images", "skipped", "read_s", "decode_s", "augment_s", "serialize_s", "send_s", "fetch_s",
          "fetch_errors")
_INDEX = {name: i for i, name in enumerate(FIELDS)}
NOTE_BYTES = 300  # one worker's storage note (``protocol.exact_messages.MAX_STORAGE_CHARS``)
STAGE_NAMES = ("fetch", "read", "decode", "augment", "serialize", "send")


class StageStats:
    """A (workers x len(FIELDS)) table of float64 in shared memory."""

    def __init__(self, workers: int, ctx: Any = None) -> None:
        self.workers = workers
        self._array = (ctx or mp).Array("d", workers * len(FIELDS), lock=False)
        self._notes = (ctx or mp).Array("c", workers * NOTE_BYTES, lock=False)

    def add(self, worker: int, name: str, value: float) -> None:
        self._array[worker * len(FIELDS) + _INDEX[name]] += value

    def value(self, worker: int, name: str) -> float:
        return self._array[worker * len(FIELDS) + _INDEX[name]]

    def note_storage(self, worker: int, error: str) -> None:
        """Worker ``worker`` waits on object storage for ``error`` ("": it no longer waits)."""
        data = error.encode("utf-8", "replace")[:NOTE_BYTES - 1]
        start = worker * NOTE_BYTES
        self._notes[start:start + NOTE_BYTES] = data + b"\0" * (NOTE_BYTES - len(data))

    def storage_waits(self) -> list[str]:
        """The errors the workers wait on object storage for, one per waiting worker (empty: none waits)."""
        notes = (self._notes[w * NOTE_BYTES:(w + 1) * NOTE_BYTES].split(b"\0", 1)[0] for w in range(self.workers))
        return [note.decode("utf-8", "replace") for note in notes if note]

    def storage_waiting(self) -> str:
        """What a status to trainers says: the first waiting worker's error, with how many wait ("" if none)."""
        waits = self.storage_waits()
        if not waits:
            return ""
        return waits[0] if len(waits) == 1 else f"{waits[0]} ({len(waits)} of {self.workers} workers wait)"

    def totals(self) -> dict[str, float]:
        width = len(FIELDS)
        return {name: sum(self._array[w * width + i] for w in range(self.workers)) for i, name in enumerate(FIELDS)}


@dataclass(frozen=True)
class RateReport:
    """Rates over one interval, as the periodic log line prints them."""

    batches_per_s: float
    images_per_s: float
    skipped_total: int
    ms_per_image: dict[str, float]

    def line(self) -> str:
        stages = " ".join(f"{k}_ms={v:.2f}" for k, v in self.ms_per_image.items())
        return (
            f"batches_per_s={self.batches_per_s:.2f} images_per_s={self.images_per_s:.1f} "
            f"skipped={self.skipped_total} {stages} (per image, summed over workers)"
        )


def rate_report(before: dict[str, float], after: dict[str, float], seconds: float) -> RateReport:
    images = after["images"] - before["images"]
    per_image = {
        stage: 1000.0 * (after[f"{stage}_s"] - before[f"{stage}_s"]) / images if images else 0.0
        for stage in STAGE_NAMES
    }
    return RateReport(
        batches_per_s=(after["batches"] - before["batches"]) / seconds,
        images_per_s=images / seconds,
        skipped_total=int(after["skipped"]),
        ms_per_image=per_image,
    )


class StorageWatch:
    """A worker's ``storage_retry.FetchWatch``: its waits on object storage go to its row of ``stats`` (the storage
    note, ``fetch_errors``, ``fetch_s``), where the daemon's status, log and metrics read them."""

    def __init__(self, stats: StageStats, worker: int) -> None:
        self.stats, self.worker = stats, worker

    def waiting(self, error: str) -> None:
        self.stats.add(self.worker, "fetch_errors", 1)
        self.stats.note_storage(self.worker, error)

    def settled(self) -> None:
        self.stats.note_storage(self.worker, "")

    def fetched(self, seconds: float) -> None:
        self.stats.add(self.worker, "fetch_s", seconds)


def watch_storage(dataset: Any, stats: StageStats, worker: int) -> None:
    """Point a dataset's shard cache (if it reads from object storage) at this worker's ``StorageWatch``."""
    source = getattr(dataset, "source", None)
    if source is not None and hasattr(source, "watch"):
        source.watch = StorageWatch(stats, worker)


def with_fetch(stages: dict[str, float], fetch_s: float) -> dict[str, float]:
    """A batch header's ``stages`` with the time its reads waited for object storage (``fetch_s``, part of the
    read time as measured) moved from ``read`` to ``fetch``; ``fetch`` only when not zero (``STAGES``' note)."""
    fetch = min(max(fetch_s, 0.0), stages.get("read", 0.0))
    if fetch <= 0.0:
        return stages
    return {"fetch": fetch, **stages, "read": stages["read"] - fetch}
