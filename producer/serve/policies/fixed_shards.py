"""What a producer serves in exact mode, and who holds what: logic only, no sockets.

The daemon's forwarding thread drives a ``FixedShardPolicy``:

- ``next_chunk(n)`` picks the next records for a worker's batch (nothing before
  ``min_trainers`` trainers joined, so in a synchronous job none starts ahead): first records
  known to be lost (re-served, oldest epoch first), then the epoch's records in its
  deterministic order, skipping what trainers consumed, hold, or what is being made.
  An epoch's successor opens as soon as its first pass is handed out (no drain at
  epoch boundaries), but at most ``EPOCHS_AHEAD`` (1) epoch beyond the oldest incomplete
  one: a small dataset and a deep queue never run several epochs ahead, and after a
  restart the open epoch is resumed (its lost records first) before the next goes on.
  Nothing opens past ``epochs`` in a finite run.
- ``on_sent`` records that a batch went to a trainer (its records are outstanding
  there); ``on_skipped`` that records failed (bad data: done, never re-served).
- ``on_hello`` adopts a trainer's state (the first hello initialises a fresh
  producer, so a restarted one resumes the epoch in progress) and *replaces*
  everything known from that trainer: records it consumed after the state it now
  reports (a trainer restarted from a checkpoint) and records outstanding under its
  previous session become servable again. Records it says it holds stay its own.
- ``take_stale`` is asked just before a made batch goes out: rows whose records a hello reported
  consumed or held while a worker was making them (a trainer dropped before reporting, then back
  with its state) are masked by the forwarder, never sent twice.
- ``on_credit`` adds consumed records and credit. Trainers live in a ``TrainerRegistry``
  (``trainers``): one it expires (silent for ``trainer_timeout``) or drops (unreachable) has
  what it held served again.
- ``route`` sends a made batch to any trainer with credit (round-robin); ``wanted`` is
  ``take_stale`` turned round, as the forwarder asks it (serving_policy.py).
- An epoch completes when every record is consumed or skipped; ``finished`` once
  ``epochs`` epochs completed.

Exactness: a record is served again only when no live trainer holds it, so
nothing is lost and nothing is consumed twice, except what a trainer consumed in
the moments before it died without reporting it (see docs/decisions.md).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import Credit, Hello, Records, Status, Work
from stoker.protocol.input_state import StreamKey, rows_by_epoch

from stoker.producer.serve.policies.serving_policy import Chunk
from stoker.producer.serve.policies.exact_policy import TrainerFacingPolicy, no_storage_wait
from stoker.producer.serve.policies.trainer_registry import Trainer, TrainerRegistry

_FREE, _MAKING = -1, -2  # owner codes besides a trainer's slot number
#: Epochs that may be open beyond the oldest incomplete one: its successor starts while its last records are
#: still in flight (no drain at the boundary), but nothing runs further ahead however much credit trainers give.
EPOCHS_AHEAD = 1
FIXED_SHARD_TAKES_NO_WORK = ("a trainer handed out splits (work) to a producer with a fixed --shard: start the "
                             "producers of an elastic pool with --shard auto")


@dataclass
class _Epoch:
    order: np.ndarray  # shard positions k in this epoch's serving order
    consumed: np.ndarray  # bool [size]: consumed by any trainer
    skipped: np.ndarray  # bool [size]: failed (bad record or sample), done
    owner: np.ndarray  # int32 [size]: _FREE, _MAKING or the slot of the trainer holding it
    cursor: int = 0  # first-pass position
    lost: deque = field(default_factory=deque)  # positions to serve again, before the first pass goes on
    by_trainer: dict[str, np.ndarray] = field(default_factory=dict)
    left: int = -1  # records neither consumed nor skipped (-1: count them); kept per message, not per epoch scan

    def settle(self, column: np.ndarray, ks: np.ndarray) -> None:
        """Mark positions ``ks`` in ``column`` (``consumed`` or ``skipped``), keeping ``left`` exact."""
        fresh = ks[~(self.consumed[ks] | self.skipped[ks])]
        column[ks] = True
        if self.left >= 0 and len(fresh):
            self.left -= len(np.unique(fresh))

    def recount(self) -> None:
        self.left = int((~(self.consumed | self.skipped)).sum())

    def done(self) -> bool:
        if self.left < 0:
            self.recount()
        return self.left == 0


class FixedShardPolicy(TrainerFacingPolicy):
    """Serving decisions for one stream (an ``ExactPolicy``); see the module doc. Not thread-safe: one thread
    drives it."""

    def __init__(self, key: StreamKey, producer_id: str, epochs: Optional[int] = None,
                 trainer_timeout: float = 10.0, spec: Optional[list[tuple[str, str, list[int]]]] = None,
                 min_trainers: int = 1, storage: Callable[[], str] = no_storage_wait) -> None:
        self.key, self.producer_id, self.epochs = key, producer_id, epochs
        self.spec = list(spec or [])
        self.min_trainers = min_trainers  # serve nothing before this many trainers joined (synchronous jobs)
        self._joined: set[str] = set()
        self.records = key.stream_records()
        self.started = False
        self.completed = 0
        self.open: dict[int, _Epoch] = {}
        self.trainers: TrainerRegistry[Trainer] = TrainerRegistry(trainer_timeout, self._release)
        self._slots: dict[str, int] = {}  # trainer id -> its owner code in the epochs' ``owner``, for the run
        self.skipped_total = 0
        self.reserved_total = 0  # records served again after a loss
        self._status_changed = False
        self.storage = storage
        self.idle = False  # the last next_chunk found nothing to serve (the epoch window): said in statuses
        #: Bumped whenever a hello or a dropped trainer may make records being made stale (``take_stale``):
        #: a batch chosen since then needs no row-by-row check.
        self.generation = 0

    # ---- epochs ----------------------------------------------------------------------------

    def _epoch(self, e: int) -> _Epoch:
        if e not in self.open:
            size = len(self.records)
            positions = self.key.local(self.key.order(e))
            self.open[e] = _Epoch(positions, np.zeros(size, bool), np.zeros(size, bool),
                                  np.full(size, _FREE, np.int32))
        return self.open[e]

    @property
    def finished(self) -> bool:
        return self.epochs is not None and self.completed >= self.epochs

    def _may_open(self, e: int) -> bool:
        return self.epochs is None or e < self.epochs

    def _close_done(self) -> None:
        while self.completed in self.open and self.open[self.completed].done():
            del self.open[self.completed]
            self.completed += 1
            self._status_changed = True
        if self.started and not self.open and self._may_open(self.completed):
            self._epoch(self.completed)

    def _requeue(self, e: int, epoch: _Epoch) -> None:
        """Positions the first pass has passed that nobody consumed, skipped or holds: serve them again."""
        passed = epoch.order[: epoch.cursor]
        free = passed[(epoch.owner[passed] == _FREE) & ~epoch.consumed[passed] & ~epoch.skipped[passed]]
        queued = set(epoch.lost)
        for k in free:
            if int(k) not in queued:
                epoch.lost.append(int(k))
                self.reserved_total += 1

    # ---- work ------------------------------------------------------------------------------

    def next_chunk(self, n: int) -> Optional[Chunk]:
        """Up to ``n`` records to make into a batch (None: nothing to serve now)."""
        if not self.started or self.finished or len(self._joined) < self.min_trainers:
            return None
        epochs: list[int] = []
        indices: list[int] = []
        e = self.completed
        while len(indices) < n and e in self.open:
            epoch = self.open[e]
            while epoch.lost and len(indices) < n:
                k = epoch.lost.popleft()
                if epoch.owner[k] == _FREE and not epoch.consumed[k] and not epoch.skipped[k]:
                    epoch.owner[k] = _MAKING
                    epochs.append(e)
                    indices.append(int(self.records[k]))
            while epoch.cursor < len(epoch.order) and len(indices) < n:
                # The first pass, a window at a time (one record at a time costs ~1 us each in NumPy scalars).
                need = n - len(indices)
                window = epoch.order[epoch.cursor:epoch.cursor + max(2 * need, 64)]
                free = np.flatnonzero((epoch.owner[window] == _FREE) & ~epoch.consumed[window]
                                      & ~epoch.skipped[window])[:need]
                epoch.cursor += int(free[-1]) + 1 if len(free) == need else len(window)
                ks = window[free]
                epoch.owner[ks] = _MAKING
                epochs.extend([e] * len(ks))
                indices.extend(self.records[ks].tolist())
            if epoch.cursor >= len(epoch.order) and self._may_open(e + 1) and e + 1 <= self.completed + EPOCHS_AHEAD:
                self._epoch(e + 1)
            e += 1
        idle = not indices
        if idle != self.idle:
            # Said at once when it becomes idle (a waiting trainer must not take it for stuck); busy again shows in
            # its batches and the next periodic status.
            self.idle, self._status_changed = idle, self._status_changed or idle
        return Chunk(epochs, indices, generation=self.generation) if indices else None

    def _positions(self, epochs: Sequence[int], indices: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        epochs_arr, indices_arr = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        return [(e, self.key.local(indices_arr[rows])) for e, rows in rows_by_epoch(epochs_arr)]

    def on_unsent(self, chunk: Chunk) -> None:
        """A chunk will not be sent (its worker died): its records are free again."""
        for e, ks in self._positions(chunk.epochs, chunk.indices):
            if e in self.open:
                epoch = self.open[e]
                ks = ks[epoch.owner[ks] == _MAKING]
                epoch.owner[ks] = _FREE
                epoch.lost.extend(int(k) for k in ks)

    def take_stale(self, epochs: np.ndarray, indices: np.ndarray, chunk: Optional[Chunk] = None) -> np.ndarray:
        """Which rows of a made batch, about to be sent, no longer belong in it.

        A batch's records are ``_MAKING`` from ``next_chunk`` until ``on_sent``. A trainer dropped
        with records it consumed but had not reported, or held, has them served again; its next
        hello (its state, its holdings) may say so while a worker is already making them into a
        batch. Such rows are stale: consumed ones are done here (freed), held ones stay the
        trainer's, and any other row no longer ``_MAKING`` was released to be served again. The
        forwarder masks stale rows (as a last batch's padding) so no record goes out twice.
        """
        stale = np.zeros(len(indices), bool)
        if chunk is not None and chunk.generation == self.generation:
            return stale  # no hello and no trainer dropped since its records were chosen
        epochs, indices = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        for e, rows in rows_by_epoch(epochs):
            if e < self.completed or e not in self.open:
                stale[rows] = True  # the whole epoch completed (or was dropped) meanwhile
                continue
            epoch = self.open[e]
            ks = self.key.local(indices[rows])
            making = epoch.owner[ks] == _MAKING
            consumed = epoch.consumed[ks]
            stale[rows[consumed | ~making]] = True
            epoch.owner[ks[consumed & making]] = _FREE
        return stale

    def on_skipped(self, epochs: list[int], indices: list[int]) -> None:
        for e, ks in self._positions(epochs, indices):
            if e in self.open:
                epoch = self.open[e]
                epoch.settle(epoch.skipped, ks)
                epoch.owner[ks] = _FREE
                self.skipped_total += len(ks)
        self._close_done()

    def wanted(self, chunk: Optional[Chunk], epochs: np.ndarray, indices: np.ndarray,
               valid: np.ndarray) -> np.ndarray:
        """The valid rows of a made batch that are not stale (``take_stale``): those still go to a trainer."""
        wanted = valid.copy()
        wanted[valid] = ~self.take_stale(epochs[valid], indices[valid], chunk)
        return wanted

    def on_sent(self, routing_id: bytes, epochs: list[int], indices: list[int], chunk: Optional[Chunk] = None) -> None:
        slot = self._slots[self.trainers.spend(routing_id).id]
        for e, ks in self._positions(epochs, indices):
            if e in self.open:
                self.open[e].owner[ks] = slot

    # ---- trainers --------------------------------------------------------------------------

    def _slot_of(self, trainer_id: str) -> int:
        return self._slots.setdefault(trainer_id, len(self._slots))

    def on_hello(self, routing_id: bytes, hello: Hello, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.generation += 1
        key = str(self.key)
        progress = hello.state.streams.get(key)
        if not self.started:
            self.started = True
            if progress is not None:
                self.completed = progress.completed
        elif progress is not None and progress.completed > self.completed:
            for e in [e for e in self.open if e < progress.completed]:
                del self.open[e]
            self.completed = progress.completed
            self._status_changed = True
        slot = self._slot_of(hello.trainer)
        # A reconnect or a restart: the previous session's holdings are released (``_release``).
        self.trainers.join(Trainer(hello.trainer, routing_id, hello.session, hello.credit, now))
        self._joined.add(hello.trainer)
        mentioned = set(progress.open) if progress is not None else set()
        mentioned |= {e for e, _ in hello.held.get(key, [])}
        for e in sorted({self.completed} | mentioned):  # epochs another incarnation had begun stay tracked
            if e >= self.completed and self._may_open(e):
                self._epoch(e)
        for e, epoch in self.open.items():
            reported = progress.open.get(e) if progress is not None else None
            previous = epoch.by_trainer.get(hello.trainer)
            if reported is not None:
                epoch.by_trainer[hello.trainer] = reported.copy()
            else:
                epoch.by_trainer.pop(hello.trainer, None)
            if previous is not None or reported is not None:
                epoch.consumed = np.zeros_like(epoch.consumed)
                for consumed in epoch.by_trainer.values():
                    epoch.consumed |= consumed
                epoch.left = -1
        for e, ks in self._held(hello.held.get(key, [])):
            if e in self.open:
                epoch = self.open[e]
                mine = ks[~epoch.consumed[ks]]
                epoch.owner[mine] = slot
        for e, epoch in self.open.items():
            self._requeue(e, epoch)
        self._close_done()
        self._status_changed = True

    def _held(self, records: Records) -> list[tuple[int, np.ndarray]]:
        out = []
        for e, indices in records:
            try:
                out.append((e, self.key.local(np.asarray(indices, np.int64))))
            except ValueError:
                continue  # records of another stream: not ours to track
        return out

    def _release(self, trainer: Trainer) -> None:
        """What ``trainer`` held becomes servable again (it died, or will report afresh): the registry's ``forget``."""
        self.generation += 1
        slot = self._slots[trainer.id]
        for e, epoch in self.open.items():
            epoch.owner[epoch.owner == slot] = _FREE
            self._requeue(e, epoch)

    def on_credit(self, routing_id: bytes, credit: Credit, now: Optional[float] = None) -> bool:
        """Apply a trainer's credit and consumed records; False if it is unknown or of an old session."""
        trainer = self.trainers.on_credit(routing_id, credit, now)
        if trainer is None:
            return False
        slot = self._slots[trainer.id]
        for e, indices in credit.consumed:
            if e < self.completed or not self._may_open(e):
                continue
            epoch = self._epoch(e)
            ks = self.key.local(np.asarray(indices, np.int64))
            mine = epoch.by_trainer.get(trainer.id)
            if mine is None:  # not setdefault: that would allocate a bitmap of the whole shard per message
                mine = epoch.by_trainer[trainer.id] = np.zeros_like(epoch.consumed)
            mine[ks] = True
            epoch.settle(epoch.consumed, ks)
            held = ks[epoch.owner[ks] == slot]
            epoch.owner[held] = _FREE
        self._close_done()
        return True

    def route(self, chunk: Optional[Chunk]) -> Optional[bytes]:
        """The trainer a made batch goes to: any with credit, round-robin (the records are chosen for no one in
        particular; None: all are full or there are none)."""
        return self.trainers.pick()

    def on_work(self, routing_id: bytes, work: Work, now: Optional[float] = None) -> bool:
        """Refused: a fixed shard's producer chooses its records itself (ProtocolError, counted by the forwarder)."""
        raise ProtocolError(FIXED_SHARD_TAKES_NO_WORK)

    def status(self, to: bytes = b"", stranger: bool = False) -> Status:
        waiting = max(0, self.min_trainers - len(self._joined)) if not self.finished else 0
        return self._addressed(Status(str(self.key), self.producer_id, self.completed, self.epochs, self.finished,
                                      self.spec, waiting, idle=self.idle, skipped=self.skipped_total), to, stranger)

    def summary(self) -> str:
        return f"{self.skipped_total} records skipped, {self.reserved_total} served again after a loss"
