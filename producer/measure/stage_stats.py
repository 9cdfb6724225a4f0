"""Per-worker counters and stage timings shared with the daemon's main process.

Each worker owns one row of a lock-free shared array and is its only writer;
the main process only reads, so no lock is needed and a torn read can at worst
be off by one update in a log line.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

FIELDS = ("batches", "images", "skipped", "read_s", "decode_s", "augment_s", "serialize_s", "send_s")
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class StageStats:
    """A (workers x len(FIELDS)) table of float64 in shared memory."""

    def __init__(self, workers: int, ctx: Any = None) -> None:
        self.workers = workers
        self._array = (ctx or mp).Array("d", workers * len(FIELDS), lock=False)

    def add(self, worker: int, name: str, value: float) -> None:
        self._array[worker * len(FIELDS) + _INDEX[name]] += value

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
        for stage in ("read", "decode", "augment", "serialize", "send")
    }
    return RateReport(
        batches_per_s=(after["batches"] - before["batches"]) / seconds,
        images_per_s=images / seconds,
        skipped_total=int(after["skipped"]),
        ms_per_image=per_image,
    )
