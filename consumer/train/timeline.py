"""What a run looked like over time, for the bottleneck report: occupancy, steps, producers' rates and stages.

``Timeline(inp)`` samples a ZMQInput every ``interval`` seconds on a thread of its
own: the queue's occupancy now, and per producer the images/s received and the
milliseconds per image its workers spent reading, decoding, augmenting and
waiting to send (from the batch headers, ``InputStats.stage_seconds``). The
training loop adds each step's duration with ``step()``. There is a sample at
``start()`` and one at ``stop()`` (which ends the sampling, bounded), so every
batch received in between is in exactly one sample's interval, however short the
run; the data is plain lists, ready for ``report.write_report``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from stoker.protocol.batch_header import STAGES


@dataclass
class Sample:
    """One sampling instant, ``t`` seconds after the start."""

    t: float
    occupancy: float
    images_per_s: dict[str, float] = field(default_factory=dict)  # per producer
    stage_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # producer -> stage -> ms per image


class Timeline:
    """Samples an input over time; see the module doc. Use as a context manager or start()/stop()."""

    def __init__(self, inp: Any, interval: float = 0.5) -> None:
        self.inp, self.interval = inp, interval
        self.samples: list[Sample] = []
        self.steps: list[tuple[float, float]] = []  # (t at the step's end, seconds it took)
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stoker-timeline", daemon=True)
        self._previous: Any = None
        self._before = self._t0
        self._base_of_last: tuple[Any, float] = (None, self._t0)  # what the latest sample was measured against

    def start(self) -> "Timeline":
        """Take the first sample (t = 0) and sample every ``interval`` from now until ``stop()``."""
        self._t0 = time.monotonic()
        self._previous, self._before = self.inp.stats, self._t0
        self._take(self._t0)
        self._thread.start()
        return self

    def step(self, seconds: float) -> None:
        """Record one training step that took ``seconds`` (any thread)."""
        with self._lock:
            self.steps.append((time.monotonic() - self._t0, seconds))

    def _take(self, now: float) -> bool:
        """Append one sample covering the time since the last; False once the input is closed."""
        try:
            stats, occupancy = self.inp.stats, self.inp.queue_occupancy()
        except Exception:  # the input closed under us: the run is over
            return False
        previous = self._previous
        sample = Sample(now - self._t0, occupancy)
        elapsed = max(now - self._before, 1e-9)
        for producer, samples in stats.samples_per_producer.items():
            new = samples - previous.samples_per_producer.get(producer, 0)
            sample.images_per_s[producer] = new / elapsed
            stages_now, stages_before = stats.stage_seconds.get(producer, {}), previous.stage_seconds.get(producer, {})
            if new > 0:
                sample.stage_ms[producer] = {s: 1000 * (stages_now.get(s, 0.0) - stages_before.get(s, 0.0)) / new
                                             for s in STAGES}
        with self._lock:
            self.samples.append(sample)
        self._base_of_last = (previous, self._before)
        self._previous, self._before = stats, now
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._take(time.monotonic()):
                return

    def stop(self) -> None:
        """Stop sampling (bounded) and take a last sample, so the timeline covers the whole run.

        A tail shorter than half an interval is merged into the sample before it: a rate over a few
        milliseconds says nothing and would dwarf the chart. Without ``start()`` it only stops.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if self._previous is None:
            return
        if self._thread.is_alive():
            self._thread.join(2.0)
        if not self._thread.is_alive():
            now = time.monotonic()
            if now - self._before < self.interval / 2 and len(self.samples) > 1:
                with self._lock:
                    self.samples.pop()
                self._previous, self._before = self._base_of_last
            self._take(now)

    def __enter__(self) -> "Timeline":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: the share of producers' working stage time (send, a wait for the trainer's credit, left out) spent waiting for
#: object storage above which a run is called storage-bound
STORAGE_BOUND_SHARE = 0.5


def storage_verdict(stage_seconds: Mapping[str, Mapping[str, float]]) -> Optional[str]:
    """"storage-bound: ..." when the producers' reads waited for object storage (their ``fetch`` stage) for more
    than ``STORAGE_BOUND_SHARE`` of their working time (``InputStats.stage_seconds``: producer -> stage -> s),
    naming the fix; None otherwise (more producers or workers would not help such a run)."""
    fetch = sum(stages.get("fetch", 0.0) for stages in stage_seconds.values())
    working = sum(v for stages in stage_seconds.values() for k, v in stages.items() if k != "send")
    if fetch <= 0.0 or fetch < STORAGE_BOUND_SHARE * working:
        return None
    return (f"storage-bound: the producers' reads waited {fetch:.1f} s for object storage ({fetch / working:.0%} "
            "of their working time), so the step waited for data; more producers or --workers will not help. "
            "Check the storage server's health and the producers' logs (their errors), raise --cache-size so "
            "shards stay cached, or put the data nearer")
