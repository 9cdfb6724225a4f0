"""The trainer's side of an elastic pool over its producers' links: who serves it, their work messages, stuck ones.

``ExactControlPlane`` makes one when the first pool producer (``--shard auto``) reports under this
trainer's session, around the ``SplitScheduler`` its ``SchedulerPlan`` makes for that dataset.

- ``join(i, status)``: producer ``i`` serves the pool and gets splits, if it serves the same pool
  (dataset, seed, epochs) and batches of the trainer's spec; else it is named once and gets no work.
- ``leave(i)``: it disconnected, left the pool or starts a new session: its unfinished splits go
  to the others (``SplitScheduler.release``).
- Work goes out as ``Work`` messages (``give_work_all``), the producers holding the fewest splits
  topped up first, so a newcomer takes the next free split; a finished pool is told to each
  producer once per session.
- ``check_stalls``: producers the scheduler takes for stuck are named and told to start afresh
  (``restart``: a hello, a new session: they drop what they queued for us), and rejoin when they answer.

Runs on the control plane's thread; the scheduler is used under the control plane's lock (steps report
consumed records from their own threads). A producer's standing here (serving the pool, told to start afresh,
told the pool is finished) is its ``KnownProducer`` record's, which that thread alone writes and reads.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from stoker.protocol.batch_spec import BatchMismatchError, BatchSpec
from stoker.protocol.exact_messages import MAX_WORK_ITEMS, Status, Work, encode_work
from stoker.protocol.input_state import StreamKey

from stoker.consumer.exact.producers import KnownProducer
from stoker.consumer.exact.pool.split_scheduler import SplitScheduler

log = logging.getLogger("stoker.consumer")


def epochs_text(epochs: Optional[int]) -> str:
    """How a run's epochs read in a message: ``2 epochs``, ``1 epoch``, or ``endless`` (None: ``--exact`` without
    ``--epochs``)."""
    return "endless" if epochs is None else f"{epochs} epoch{'' if epochs == 1 else 's'}"


def serves_pool(status: Status, session: int) -> bool:
    """Whether ``status`` says its producer serves an elastic pool under this trainer's current ``session``."""
    return StreamKey.names_pool(status.stream) and status.session == session and session > 0


class PoolWork:
    """See the module doc. ``producers``: the control plane's records, by number; ``spec``: the batches pool producers
    must make (None: not checked); ``send(i, frame)`` sends producer ``i`` a message; ``restart(i)`` gives it a new
    session."""

    def __init__(self, scheduler: SplitScheduler, spec: Optional[BatchSpec], producers: Sequence[KnownProducer],
                 lock: threading.Lock, send: Callable[[int, bytes], bool], restart: Callable[[int], None]) -> None:
        self.scheduler = scheduler
        self.key = str(scheduler.key)
        self._spec, self._producers, self._lock, self._send, self._restart = spec, producers, lock, send, restart
        self._refused: set[str] = set()  # producer ids named for serving another pool
        share = f", share {scheduler.rank}/{scheduler.world}" if scheduler.world > 1 else ""
        layout = (f", shard by shard ({scheduler.key.block} records each, {scheduler.key.window} a window)"
                  if scheduler.key.block else "")
        log.info("elastic pool of %d records (seed %d): handing out splits of at most %d records (%d or more an "
                 "epoch)%s%s", scheduler.records, scheduler.key.seed, scheduler.split, scheduler.splits, layout, share)

    @property
    def finished(self) -> bool:
        return self.scheduler.finished

    def pooled(self) -> list[int]:
        """The producers serving this trainer's splits under their current session, by number."""
        return [i for i, p in enumerate(self._producers) if p.pooled]

    def _refusal(self, status: Status) -> str:
        """Why a producer reporting ``status`` gets no work ("" if it may join)."""
        sched = self.scheduler
        if status.stream != self.key or status.epochs != sched.epochs:
            return (f"serves {status.stream} ({epochs_text(status.epochs)}) but this trainer's pool is {sched.key} "
                    f"({epochs_text(sched.epochs)}); start every producer of a pool on the same dataset with the "
                    "same --seed, --epochs and --shuffle-window")
        if self._spec is not None and status.spec:
            try:
                self._spec.check_declared(status.producer, status.spec)
            except BatchMismatchError as exc:
                return str(exc)
        return ""

    def join(self, i: int, status: Status) -> None:
        """Producer ``i`` reported ``status`` under this trainer's session: hand it splits (see the module doc)."""
        p = self._producers[i]
        if p.pooled:
            return
        why = self._refusal(status)
        if why:
            if status.producer not in self._refused:
                self._refused.add(status.producer)
                log.error("producer %s gets no work: %s", status.producer, why)
            return
        p.pooled = True
        if self.scheduler.holdings is not None:  # which shards it caches: it gets their splits
            with self._lock:
                self.scheduler.holdings.note(i, status.cache, status.held)
        if p.restarted:
            p.restarted = False
            log.warning("elastic pool: producer %s answers again: it takes new work", p.name())
        self._give_work(i)  # new to the scheduler: its first top-up makes it known
        self.give_work_all()

    def leave(self, i: int) -> None:
        """Producer ``i`` no longer serves under its session (gone, cut off, restarted): its splits go back."""
        p = self._producers[i]
        if p.pooled:
            p.pooled = False
            with self._lock:
                released = self.scheduler.release(i)
            if released:
                log.info("producer %s left or restarted: %d unfinished split(s) go to the others",
                         p.address, released)

    def give_work_all(self) -> None:
        """Top up every pooled producer, those holding the fewest splits first: when splits are scarce (the
        window's end, a small dataset) a producer that joined takes the next free one."""
        producers = self._producers
        with self._lock:
            order = self.pooled() if self.scheduler.finished else \
                [i for i in self.scheduler.wants_work() if producers[i].pooled]
        for i in order:
            self._give_work(i)

    def _give_work(self, i: int) -> None:
        with self._lock:
            finished = self.scheduler.finished
            items = [] if finished else self.scheduler.top_up(i)
        p = self._producers[i]
        session = p.session
        if finished and p.told_finished_in != session:
            p.told_finished_in = session
            self._send(i, encode_work(Work(session, [], finished=True)))
        elif items:
            for start in range(0, len(items), MAX_WORK_ITEMS):
                self._send(i, encode_work(Work(session, items[start:start + MAX_WORK_ITEMS])))

    def arrived(self, i: int, stream: str, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The rows of a batch of producer ``i`` to keep: new records of this trainer's share (none of another
        pool's). Every batch of the pool goes through the scheduler, also one from a producer just taken for gone:
        what it sends may still be new, and what is not is dropped."""
        if stream != self.key:
            return np.zeros(len(indices), bool)  # no pool of this trainer's: nothing of it is asked for
        with self._lock:
            keep = self.scheduler.arrived(epochs, indices, mask, producer=i)
        self.give_work_all()
        return keep

    def consumed(self, stream: str, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step took these records of ``stream`` (the caller holds the lock)."""
        if stream == self.key:
            self.scheduler.consumed(epochs, indices)

    def queue_full(self, now: float) -> None:
        with self._lock:
            self.scheduler.queue_full(now)

    def check_stalls(self, now: float) -> None:
        """Take the producers the scheduler finds stuck out of the pool until they answer (see the module doc)."""
        with self._lock:
            stuck = self.scheduler.stalls(now)
        for producer, silent, held in stuck:
            status = self._producers[producer].status
            if status is not None and status.storage:  # its own status says why: blame storage, not it
                log.warning("elastic pool: producer %s is waiting on object storage (%s): no new record for %.0f "
                            "s while this trainer waited; its %d record(s) go to the other producers until "
                            "storage answers it again", self._producers[producer].name(), status.storage, silent,
                            held)
            else:
                log.warning("elastic pool: producer %s sent no new record for %.0f s while this trainer waited "
                            "(stall bound %.1f s); its %d record(s) go to the other producers. It gets no new work "
                            "until it answers again", self._producers[producer].name(), silent,
                            self.scheduler.pace.stall_bound(), held)
            # A new session: the producer drops what it queued for us (it would make it for nothing) and rejoins
            # the pool when it answers; batches it made before are stale and dropped.
            self._producers[producer].restarted = True
            self._restart(producer)
        if stuck:
            self.give_work_all()

    def holdings(self, i: int) -> str:
        """What pooled producer ``i`` holds, for a trainer's report of what it waits for."""
        with self._lock:
            return (f", holds {self.scheduler.holding(i)} split(s) ({self.scheduler.records_held(i)} records)"
                    + (" STUCK" if i in self.scheduler.stuck else ""))

    def summary(self) -> str:
        with self._lock:
            epochs = list(self.scheduler.open.values())
            unit = epochs[0].LEFT_UNIT if epochs else "record"  # what ``left`` counts: records, or splits (order 2)
            return (f"elastic pool: epochs open {sorted(self.scheduler.open)}, "
                    f"{sum(e.left for e in epochs)} {unit}(s) of them not consumed")

    def counters(self) -> tuple[int, int, int, int]:
        """``(splits re-served from stuck producers, backup splits, wasted records, producers taken for stuck)``."""
        sched = self.scheduler
        return sched.reserved, sched.backups, sched.duplicates, sched.stalls_seen
