"""How fast each producer of an elastic pool makes progress: what ``SplitScheduler`` judges stuck and slow by.

- *Progress* is a batch of a producer with records that arrived first. ``delivered`` notes when, and
  measures the producer's *pace* (seconds per record while it held work, a moving average) and the
  pool's recent *progress gaps* (a producer's time between two such batches).
- ``stall_bound()``: seconds without progress after which a producer holding work is stuck: the floor
  ``stall_after``, or ``STALL_FACTOR`` times the median recent gap if longer (a pool of slow pipelines or
  large batches waits longer).
- ``overdue(...)``: the holders past the bound, counted only while the trainer's queue had room or others
  moved on (a full queue means credit, not the producer, holds it back).
- ``straggler(...)``: the split an idle producer backs up: the one of the slowest holder, if that holder's
  pace is ``factor`` times the idle one's (MapReduce's backup tasks; LATE's judging by progress rate).

What is measured of a producer is its record's ``pace`` (``pool_member``). Times are ``time.monotonic()`` or a
test's ``now``. Not thread-safe: the scheduler's caller holds a lock.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Hashable, Iterable, Iterator, Optional, Sequence, TypeVar

from stoker.consumer.exact.pool.pool_member import PoolMembers, ProducerPace

STALL_FACTOR = 4.0  # the stall bound is at least this many times the median of the pool's recent progress gaps
_GAPS = 64  # recent progress gaps kept
_PACE_WEIGHT = 0.3  # weight of the newest sample in a producer's seconds-per-record average
_PACE_SAMPLES = 4  # batches a holder's pace is measured over before a backup is judged by it
_FULL_LATELY_S = 1.0  # no backups this soon after the queue was full: credit, not pace, limited producers

Split = TypeVar("Split", bound=Hashable)


class PoolPace:
    """See the module doc. ``stall_after``: the floor of the stall bound (None: never take a producer for stuck);
    ``members``: the pool's per-producer records, whose ``pace`` this measures (the scheduler owns them)."""

    def __init__(self, stall_after: Optional[float], members: PoolMembers) -> None:
        self.stall_after = stall_after
        self._members = members
        self._gaps: deque = deque(maxlen=_GAPS)
        self.queue_full_at = float("-inf")  # the trainer's queue was last full (producers wait for credit)

    def _of(self, producer: int, now: float) -> ProducerPace:
        member = self._members.of(producer)
        if member.pace is None:
            member.pace = ProducerPace(now)
        return member.pace

    def _known(self, producer: int) -> Optional[ProducerPace]:
        member = self._members.get(producer)
        return member.pace if member is not None else None

    def queue_full(self, now: float) -> None:
        """The trainer's queue is full: producers wait for credit now, so nobody is judged stuck or slow."""
        self.queue_full_at = now

    def holds(self, producer: int, now: float, idle: bool) -> None:
        """``producer`` is handed a split; ``idle``: it held none until now, so its clock starts here."""
        pace = self._of(producer, now)
        if idle:
            pace.busy_since = now

    def woke(self, producer: int, now: float) -> None:
        """A producer taken for stuck delivered again: its clock starts afresh."""
        self._of(producer, now).busy_since = now

    def stall_bound(self) -> float:
        """Seconds without progress after which a producer holding work is stuck (see the module doc)."""
        floor = self.stall_after if self.stall_after is not None else float("inf")
        if not self._gaps:
            return floor
        return max(floor, STALL_FACTOR * statistics.median(self._gaps))

    def overdue(self, holders: Sequence[int], live: Sequence[int], now: float) -> Iterator[tuple[int, float]]:
        """``(producer, seconds without progress)`` for each of ``holders`` (producers holding work) past the stall
        bound; ``live``: every producer that could take work, holding or not (whether others moved on)."""
        bound = self.stall_bound()
        # The two latest progress times: "the others moved on" is the latest of someone else's.
        known = ((self._known(p), p) for p in live)
        latest = sorted(((pace.last_fresh, p) for pace, p in known if pace is not None), reverse=True)[:2]
        for producer in holders:
            pace = self._of(producer, now)
            # A full queue excuses silence (credit, not the producer, holds it back) unless others moved on meanwhile:
            # the receiver reads every producer in turn, so one that others outpace by the bound is not waiting.
            own = max(pace.last_fresh, pace.busy_since)
            moved = next((t for t, p in latest if p != producer), float("-inf"))
            excuse = self.queue_full_at if moved - own <= bound else float("-inf")
            if now - max(own, excuse) > bound:
                yield producer, now - own

    def delivered(self, producer: int, fresh: int, holding: bool, now: float) -> None:
        """A batch of ``producer`` arrived with ``fresh`` records first; ``holding``: it holds unfinished splits (its
        pace is measured only while it has work)."""
        pace = self._of(producer, now)
        if not fresh:
            return
        began = max(pace.last_fresh, pace.busy_since, self.queue_full_at)
        if now > began and holding:
            self._gaps.append(now - began)
            sample = (now - began) / fresh
            pace.seconds_per_record = sample if pace.seconds_per_record is None else \
                (1 - _PACE_WEIGHT) * pace.seconds_per_record + _PACE_WEIGHT * sample
            pace.samples += 1
        pace.last_fresh = now

    def _estimate(self, producer: int, samples: int = 1) -> Optional[float]:
        """Seconds per record of ``producer``, once measured over at least ``samples`` batches (else None)."""
        pace = self._known(producer)
        return pace.seconds_per_record if pace is not None and pace.samples >= samples else None

    def straggler(self, idle: int, serving: Iterable[tuple[int, Split]], now: float,
                  factor: float) -> Optional[Split]:
        """Of ``serving`` (``(holder, the split it is serving)``), the split of the slowest holder if its pace is
        ``factor`` times ``idle``'s (the pool's median if ``idle``'s is not known); None if none is, no pace is known
        yet (``_PACE_SAMPLES`` batches), or the trainer's queue was full lately (credit, not pace, limits)."""
        if now - self.queue_full_at < _FULL_LATELY_S:
            return None
        paces = [m.pace.seconds_per_record for m in self._members.values()
                 if m.pace is not None and m.pace.seconds_per_record]
        if not paces:
            return None
        own = self._estimate(idle) or statistics.median(paces)
        worst, worst_ratio = None, factor
        for producer, split in serving:
            pace = self._estimate(producer, _PACE_SAMPLES)
            if pace and pace / own > worst_ratio:
                worst, worst_ratio = split, pace / own
        return worst
