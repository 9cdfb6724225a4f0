"""This trainer's seat at an elastic pool: empty until the first pool producer reports, then its ``PoolWork``.

The control plane asks every pool question here whether or not it serves a pool (fixed shards, or no pool
producer reported yet), so the answers for "no pool" live in one place:

- ``plan(plan, spec)``: what a pool's scheduler is made from but the dataset (the control plane's
  ``configure``); a pool producer that reports before this joins then.
- ``reported(i, status, session)``: a producer's status; one serving the pool under this trainer's session
  joins (``join``). The first pool producer names the dataset: the scheduler is made from the plan on the
  ledger's progress of that stream (``ConsumedLedger.pool_progress``, lent to it to read; it reports the epochs
  it completes to ``ConsumedLedger.complete_pool_epoch``), the split noted in the ledger; then every pool
  producer is handed work (``PoolWork.join``). ``leave(i)``: its splits go back.
  A fixed shard's producer, to a trainer of a share of several, is named once: shares apply to pools.
- ``arrived`` answers a pool batch's rows to keep: none of a pool this trainer has no seat at.

Used on the control plane's thread; ``consumed`` is called by the steps under the ledger's lock.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.exact_messages import Status
from stoker.protocol.input_state import StreamKey

from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.producers import KnownProducer
from stoker.consumer.exact.pool.pool_work import PoolWork, serves_pool
from stoker.consumer.exact.pool.split_plan import SchedulerPlan
from stoker.consumer.exact.pool.split_scheduler import SplitScheduler

log = logging.getLogger("stoker.consumer")


class PoolSeat:
    """See the module doc. ``share``: ``(rank, world)`` of this trainer; ``producers``: the control plane's records,
    by number; ``send(i, frame)`` sends producer ``i`` a message; ``restart(i)`` gives it a new session."""

    def __init__(self, ledger: ConsumedLedger, share: tuple[int, int], producers: Sequence[KnownProducer],
                 send: Callable[[int, bytes], bool], restart: Callable[[int], None]) -> None:
        self._ledger, self._share, self._producers, self._send, self._restart = ledger, share, producers, send, restart
        self._warned_share = False
        self._plan: Optional[SchedulerPlan] = None  # an elastic pool's scheduler, all but the dataset
        self._spec: Optional[BatchSpec] = None
        self.work: Optional[PoolWork] = None  # made when the first pool producer reports

    def plan(self, plan: SchedulerPlan, spec: BatchSpec) -> None:
        """What the pool's scheduler is made from, and the batches its producers must make (once)."""
        self._plan, self._spec = plan, spec

    @property
    def scheduler(self) -> Optional[SplitScheduler]:
        return self.work.scheduler if self.work is not None else None

    def reported(self, i: int, status: Status, session: int) -> None:
        """Producer ``i`` reported ``status`` while this trainer's session with it is ``session``: it joins if it
        serves an elastic pool under that session; a fixed shard's producer is named once to a trainer of a share
        of several (the share applies to pools only)."""
        if serves_pool(status, session):
            self.join(i, status)
        elif status.stream and not StreamKey.names_pool(status.stream) and self._share[1] > 1 \
                and not self._warned_share:
            self._warned_share = True
            log.warning("share %d/%d applies to elastic pools (producers --shard auto); producer %s serves the "
                        "fixed shard %s, so this trainer takes what its credit earns (the share only names this "
                        "trainer among its job's for a merged state)", *self._share, status.producer, status.stream)

    def join(self, i: int, status: Status) -> None:
        """Producer ``i`` serves an elastic pool: hand it splits (the first such producer defines the pool)."""
        if self._plan is None:
            return  # plan() comes first: the control plane joins it then
        if self.work is None:
            stream, ledger = status.stream, self._ledger
            with ledger.lock:
                scheduler = self._plan.scheduler(StreamKey.parse(stream), ledger.pool_progress(stream),
                                                 partial(ledger.complete_pool_epoch, stream), status.epochs)
                ledger.note_split(stream, scheduler.split)
                self.work = PoolWork(scheduler, self._spec, self._producers, ledger.lock, self._send, self._restart)
        self.work.join(i, status)

    def leave(self, i: int) -> None:
        """Producer ``i`` no longer serves under its session (gone, cut off, restarted): its splits go back."""
        if self.work is not None:
            self.work.leave(i)

    def arrived(self, i: int, stream: str, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The rows of a pool batch of producer ``i`` to keep (``PoolWork.arrived``)."""
        if self.work is None:
            return np.zeros(len(indices), bool)  # no pool of this trainer's: nothing of it is asked for
        return self.work.arrived(i, stream, epochs, indices, mask)

    def consumed(self, stream: str, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step took these records of ``stream`` (the caller holds the ledger's lock)."""
        if self.work is not None:
            self.work.consumed(stream, epochs, indices)

    def give_work_all(self) -> None:
        if self.work is not None:
            self.work.give_work_all()

    def queue_full(self, now: float) -> None:
        if self.work is not None:
            self.work.queue_full(now)

    def check_stalls(self, now: float) -> None:
        if self.work is not None:
            self.work.check_stalls(now)

    def holdings(self, i: int) -> str:
        """What pooled producer ``i`` holds, for a trainer's report of what it waits for ("" if not pooled)."""
        return self.work.holdings(i) if self.work is not None and self._producers[i].pooled else ""

    def summary(self) -> list[str]:
        """The pool's line in that report (none without a pool)."""
        return [self.work.summary()] if self.work is not None else []

    def counters(self) -> tuple[int, int, int, int]:
        """``(splits re-served from stuck producers, backup splits, wasted records, producers taken for stuck)``."""
        return self.work.counters() if self.work is not None else (0, 0, 0, 0)

    @property
    def finished(self) -> Optional[bool]:
        """Whether the pool's epochs are all consumed (None: no pool)."""
        return self.work.finished if self.work is not None else None

    def close(self) -> None:
        if self.work is not None:
            self.work.scheduler.epoch_log.flush()  # epochs completed since the last summary line
