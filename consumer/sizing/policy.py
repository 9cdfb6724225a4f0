"""From a fractional need to a number of producers: prompt up, slow and clear down, no flapping.

``needed`` (producers, headroom included, fractional) comes from a trainer's demand and the producers' capacity
(``pool_sizing.py``), or from the sum over a job's trainers (``stoker cluster --autoscale``): the same policy rounds
either, once. Up: ``ceil(needed)`` at once (a starving trainer waits for nothing). Down: only when even
``ceil(needed x (1 + down_margin))`` stayed below the current answer for ``down_hold_s``, and then to the largest
such value seen while holding: a need near a boundary (2.0 +- noise) cannot move the answer back and forth, and a
short pause (evaluation, a checkpoint) is not a reason to give producers back. Clock injectable (tests).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional


class SizingPolicy:
    """See the module doc. Not thread-safe: one owner calls ``decide``."""

    def __init__(self, down_margin: float = 0.15, down_hold_s: float = 60.0, min_producers: int = 1,
                 max_producers: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if down_margin < 0 or down_hold_s < 0 or not 0 <= min_producers <= max_producers:
            raise ValueError(f"down_margin >= 0, down_hold_s >= 0 and 0 <= min_producers <= max_producers, got "
                             f"{down_margin}, {down_hold_s}, {min_producers}, {max_producers}")
        self.down_margin = down_margin
        self.down_hold_s = down_hold_s
        self.min_producers = min_producers
        self.max_producers = max_producers
        self._clock = clock
        self.desired: Optional[int] = None
        self._below_since: Optional[float] = None
        self._below_max = 0

    def decide(self, needed: Optional[float]) -> Optional[int]:
        """The answer after this reading (None: no reading yet, the answer stands)."""
        if needed is None or not math.isfinite(needed):
            return self.desired
        up = self._bounded(math.ceil(max(0.0, needed) - 1e-9))
        down = self._bounded(math.ceil(max(0.0, needed) * (1 + self.down_margin) - 1e-9))
        now = self._clock()
        if self.desired is None or up > self.desired:
            self.desired, self._below_since = up, None
        elif down < self.desired:
            if self._below_since is None:
                self._below_since, self._below_max = now, down
            else:
                self._below_max = max(self._below_max, down)
                if now - self._below_since >= self.down_hold_s:
                    self.desired, self._below_since = self._below_max, None
        else:
            self._below_since = None
        return self.desired

    def _bounded(self, count: int) -> int:
        return min(self.max_producers, max(self.min_producers, count))
