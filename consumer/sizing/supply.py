"""What one producer can supply: images/s it would make if its workers never waited to hand a batch off.

Every batch header carries the seconds its worker spent per stage (``protocol/batch_header.py`` ``STAGES``): the
work (fetch, read, decode, augment) and ``send``, the wait to hand the batch off (backpressure). A producer whose
trainers are not input-bound is throttled, so its observed rate says nothing of what it could do; its work time
does. Per (producer, worker): rows made per second of work, recency-weighted (a decay of ``tau_s``); a producer's
capacity is the sum over its workers seen within ``window_s``. Across producers, the mean is the supply one more
producer adds. A worker this trainer has not heard from within the window (many trainers, slow batches) is left
out: capacity is under-read, which errs towards more producers.

Bounded: at most ``max_workers`` (producer, worker) entries, the stalest dropped first. Thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

#: Stages that are waiting, not work: a worker blocked handing a batch off could have made more.
WAIT_STAGES = frozenset({"send"})
#: A batch's work under this many seconds is not timed (pre-made batches, ``--repeat-batches``): it says nothing.
MIN_WORK_S = 1e-4


@dataclass(frozen=True)
class Supply:
    """``per_producer_images_per_s``: mean capacity of the producers heard from in the window (``producers``)."""

    per_producer_images_per_s: float
    producers: int
    total_images_per_s: float


class SupplyMeter:
    """See the module doc. ``clock`` is injectable (tests)."""

    def __init__(self, window_s: float = 120.0, tau_s: float = 30.0, max_workers: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.tau_s = tau_s
        self.max_workers = max_workers
        self._clock = clock
        self._lock = threading.Lock()
        # (producer, worker) -> [rows, work seconds, last seen]; rows and seconds decay together
        self._workers: dict[tuple[str, int], list[float]] = {}

    def batch(self, producer: str, worker: int, rows: int, stages: Mapping[str, float]) -> None:
        """A batch from ``producer``'s ``worker`` with ``rows`` real rows and its header's stage seconds."""
        work = sum(seconds for name, seconds in stages.items() if name not in WAIT_STAGES)
        if rows <= 0 or work < MIN_WORK_S:
            return
        now = self._clock()
        key = (producer, worker)
        with self._lock:
            entry = self._workers.get(key)
            if entry is None:
                if len(self._workers) >= self.max_workers:
                    del self._workers[min(self._workers, key=lambda k: self._workers[k][2])]
                self._workers[key] = [float(rows), work, now]
                return
            keep = math.exp(-max(0.0, now - entry[2]) / self.tau_s)
            entry[0] = entry[0] * keep + rows
            entry[1] = entry[1] * keep + work
            entry[2] = now

    def estimate(self) -> Optional[Supply]:
        """The producers' capacities now; None before any timed batch within the window."""
        now = self._clock()
        per_producer: dict[str, float] = {}
        with self._lock:
            for (producer, _), (rows, work, seen) in self._workers.items():
                if now - seen <= self.window_s and work > 0:
                    per_producer[producer] = per_producer.get(producer, 0.0) + rows / work
        if not per_producer:
            return None
        total = sum(per_producer.values())
        return Supply(per_producer_images_per_s=total / len(per_producer), producers=len(per_producer),
                      total_images_per_s=total)
