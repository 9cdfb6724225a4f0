"""What one producer can supply: images/s it would make if its workers never waited to hand a batch off.

Every batch header carries the seconds its worker spent per stage (``protocol/batch_header.py`` ``STAGES``): the
work (fetch, read, decode, augment) and ``send``, the wait to hand the batch off (backpressure). A producer whose
trainers are not input-bound is throttled, so its observed rate says nothing of what it could do; its work time
does. Per (producer, worker): rows made per second of work, recency-weighted (a decay of ``tau_s``); a producer's
capacity is its workers' mean rate times its workers, counted as the highest worker index heard within
``window_s`` plus one: with many trainers each hears a share of a producer's batches, and some of a throttled
producer's workers not at all, so summing the workers heard would under-read it. Across remote producers, the mean
is the supply one more producer adds. Producers on the trainer's own host (ids ``LOCAL_PRODUCER_PREFIX``,
``consumer/placement``) are summed apart: the pool adds remote ones, so the need is what the local ones leave.

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
#: The ids of producers a trainer starts on its own host (``consumer/placement``): not what the pool adds.
LOCAL_PRODUCER_PREFIX = "local-"


@dataclass(frozen=True)
class Supply:
    """``per_producer_images_per_s``: mean capacity of the remote producers heard from in the window (of the local
    ones where no remote one was heard); ``producers``: remote producers heard; ``local_images_per_s``: the
    capacity of the producers on the trainer's host, ``local_producers`` of them."""

    per_producer_images_per_s: float
    producers: int
    total_images_per_s: float
    local_images_per_s: float = 0.0
    local_producers: int = 0


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
        rates: dict[str, list[float]] = {}
        workers: dict[str, int] = {}
        with self._lock:
            for (producer, worker), (rows, work, seen) in self._workers.items():
                if now - seen <= self.window_s and work > 0:
                    rates.setdefault(producer, []).append(rows / work)
                    workers[producer] = max(workers.get(producer, 0), worker + 1)
        if not rates:
            return None
        capacity = {p: workers[p] * sum(r) / len(r) for p, r in rates.items()}
        local = [c for p, c in capacity.items() if p.startswith(LOCAL_PRODUCER_PREFIX)]
        remote = [c for p, c in capacity.items() if not p.startswith(LOCAL_PRODUCER_PREFIX)]
        typical = remote or local
        return Supply(per_producer_images_per_s=sum(typical) / len(typical), producers=len(remote),
                      total_images_per_s=sum(capacity.values()), local_images_per_s=sum(local),
                      local_producers=len(local))
