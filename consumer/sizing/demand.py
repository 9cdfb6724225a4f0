"""A trainer's demand for input: the images/s its step would take if it never waited for a batch.

Over a sliding window, ``demand = images consumed / (window - time spent waiting for input)``: the step's own rate,
whether the input kept up or not. Not input-bound (the trainer waited under ``INPUT_BOUND_WAIT`` of the window),
demand is what it took; input-bound, it is more, by the share of time it waited.

Where the wait comes from: an iterable facade (BatchStream, TorchInput) times it where it blocks on its queue
(``begin_wait``/``end_wait``, exact; a wait in progress is booked at each sample, so a long one lands in the
windows it spans, not all in the one it ends in); a facade whose framework takes batches inside its own graph (ZMQInput) cannot, and the meter
counts the time its queue was seen empty at the core's samples instead. That over-counts near balance (an empty
queue whose next batch arrives in time costs the step nothing), which errs towards more producers; once they come,
the queue fills and the estimate is exact again. Consumed batches are those counted delivered minus those queued
(a staged or blocked batch off by at most the staging depth, which cancels in a window's difference).

Thread-safe: the core's sampler thread calls ``sample``, a facade's consuming thread ``waited``, anyone ``estimate``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

#: A trainer that waits more than this share of the window is input-bound.
INPUT_BOUND_WAIT = 0.05
#: Demand is never read as more than this many times what was consumed (a window spent almost all waiting says
#: "far more", not a number to trust): the pool grows by steps and the estimate sharpens as it does.
MAX_DEMAND_FACTOR = 20.0


@dataclass(frozen=True)
class Demand:
    """One window's reading. ``images_per_s``: the step's rate if it never waited; ``consumed_images_per_s``: what
    it took; ``wait_fraction``: the share of the window it waited; ``wait_timed``: True where the facade timed its
    waits, False where they are estimated from an empty queue."""

    images_per_s: float
    consumed_images_per_s: float
    wait_fraction: float
    input_bound: bool
    window_s: float
    wait_timed: bool


class DemandMeter:
    """See the module doc. ``clock`` is injectable (tests); ``window_s`` is the span each estimate covers."""

    def __init__(self, batch_size: int, window_s: float = 10.0, min_window_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if batch_size < 1 or window_s <= 0 or not 0 < min_window_s <= window_s:
            raise ValueError(f"batch_size >= 1 and 0 < min_window_s <= window_s, got {batch_size}, {min_window_s}, "
                             f"{window_s}")
        self.batch_size = batch_size
        self.window_s = window_s
        self.min_window_s = min_window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wait_timed = False
        self._waited_s = 0.0  # cumulative seconds the trainer waited (timed, or estimated from empty samples)
        self._waiting_since: Optional[float] = None  # a timed wait in progress, booked up to this time
        self._samples: deque[tuple[float, int, float]] = deque()  # (time, consumed batches, waited seconds)

    def time_waits(self) -> None:
        """The facade times its own waits from now on (``waited``); the empty-queue estimate stops."""
        with self._lock:
            self._wait_timed = True

    def begin_wait(self) -> None:
        """The trainer starts waiting for a batch (an iterable facade, where it blocks on its queue)."""
        now = self._clock()
        with self._lock:
            self._waiting_since = now

    def end_wait(self) -> None:
        """The wait ``begin_wait`` began is over: what is not booked yet is."""
        now = self._clock()
        with self._lock:
            if self._waiting_since is not None:
                self._waited_s += max(0.0, now - self._waiting_since)
                self._waiting_since = None

    def sample(self, delivered: int, queued: int) -> None:
        """The core's periodic sample: batches counted delivered so far and batches queued now."""
        now = self._clock()
        with self._lock:
            if not self._wait_timed and queued == 0 and self._samples:
                self._waited_s += now - self._samples[-1][0]  # empty since the last sample, as far as we know
            if self._waiting_since is not None:  # a wait in progress: book it up to now, in this window
                self._waited_s += max(0.0, now - self._waiting_since)
                self._waiting_since = now
            self._samples.append((now, max(0, delivered - queued), self._waited_s))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
                self._samples.popleft()

    def estimate(self) -> Optional[Demand]:
        """The latest window's demand; None until ``min_window_s`` is covered, or while nothing is consumed (a
        paused trainer, evaluating or checkpointing, says nothing about its step)."""
        with self._lock:
            if len(self._samples) < 2:
                return None
            (t0, c0, w0), (t1, c1, w1) = self._samples[0], self._samples[-1]
            timed = self._wait_timed
        elapsed = t1 - t0
        consumed = c1 - c0
        if elapsed < self.min_window_s or consumed <= 0:
            return None
        waited = min(max(0.0, w1 - w0), elapsed)
        busy = max(elapsed - waited, elapsed / MAX_DEMAND_FACTOR)
        images = consumed * self.batch_size
        wait_fraction = waited / elapsed
        return Demand(images_per_s=images / busy, consumed_images_per_s=images / elapsed,
                      wait_fraction=wait_fraction, input_bound=wait_fraction > INPUT_BOUND_WAIT, window_s=elapsed,
                      wait_timed=timed)
