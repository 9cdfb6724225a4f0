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
  ``epochs`` epochs completed. Each open epoch's bookkeeping (who holds each record, the
  first pass, what is lost) is a ``ShardEpoch`` (shard_epoch.py).

Exactness: a record is served again only when no live trainer holds it, so
nothing is lost and nothing is consumed twice, except what a trainer consumed in
the moments before it died without reporting it (see docs/decisions.md).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import Credit, Hello, Records, Status, Work
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.epochs.stream_progress import consumed_records
from stoker.protocol.input_state import Progress, StreamKey, rows_by_epoch

from stoker.producer.serve.policies.serving_policy import Chunk
from stoker.producer.serve.policies.exact_policy import TrainerFacingPolicy, no_storage_wait
from stoker.producer.serve.policies.shard_epoch import FREE, MAKING, ShardEpoch
from stoker.producer.serve.policies.trainer_registry import Trainer, TrainerRegistry

#: Epochs that may be open beyond the oldest incomplete one: its successor starts while its last records are
#: still in flight (no drain at the boundary), but nothing runs further ahead however much credit trainers give.
EPOCHS_AHEAD = 1
FIXED_SHARD_TAKES_NO_WORK = ("a trainer handed out splits (work) to a producer with a fixed --shard: start the "
                             "producers of an elastic pool with --shard auto")


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
        key.check_whole_order()  # its epochs are per-record arrays over the stream (shard_epoch.py)
        self.started = False
        self.completed = 0
        self.open: dict[int, ShardEpoch] = {}
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

    def _epoch(self, e: int) -> ShardEpoch:
        if e not in self.open:
            key = self.key  # order 2 orders the stream's own records k: no detour through the dataset's indices
            order = key.lazy_order().records(e, 0, key.size) if key.order_version == 2 else key.local(key.order(e))
            self.open[e] = ShardEpoch.fresh(order, key.size)
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
            if epoch.lost:  # served again first, before the first pass goes on
                lost = epoch.take_lost(n - len(indices))
                epochs.extend([e] * len(lost))
                indices.extend(self.key.records_of(np.asarray(lost, np.int64)).tolist())
            while not epoch.first_pass_done and len(indices) < n:
                ks = epoch.take_first_pass(n - len(indices))
                epochs.extend([e] * len(ks))
                indices.extend(self.key.records_of(ks).tolist())
            if epoch.first_pass_done and self._may_open(e + 1) and e + 1 <= self.completed + EPOCHS_AHEAD:
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
                self.open[e].unmake(ks)

    def take_stale(self, epochs: np.ndarray, indices: np.ndarray, chunk: Optional[Chunk] = None) -> np.ndarray:
        """Which rows of a made batch, about to be sent, no longer belong in it.

        A batch's records are ``MAKING`` from ``next_chunk`` until ``on_sent``. A trainer dropped
        with records it consumed but had not reported, or held, has them served again; its next
        hello (its state, its holdings) may say so while a worker is already making them into a
        batch. Such rows are stale: consumed ones are done here (freed), held ones stay the
        trainer's, and any other row no longer ``MAKING`` was released to be served again. The
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
            making = epoch.owner[ks] == MAKING
            consumed = epoch.consumed[ks]
            stale[rows[consumed | ~making]] = True
            epoch.owner[ks[consumed & making]] = FREE
        return stale

    def on_skipped(self, epochs: list[int], indices: list[int]) -> None:
        for e, ks in self._positions(epochs, indices):
            if e in self.open:
                epoch = self.open[e]
                epoch.settle(epoch.skipped, ks)
                epoch.owner[ks] = FREE
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
            epoch.adopt_consumed(hello.trainer, self._reported(progress, e))
        for e, ks in self._held(hello.held.get(key, [])):
            if e in self.open:
                epoch = self.open[e]
                mine = ks[~epoch.consumed[ks]]
                epoch.owner[mine] = slot
        for epoch in self.open.values():
            self.reserved_total += epoch.requeue()
        self._close_done()
        self._status_changed = True

    def _reported(self, progress: Optional[Progress], e: int) -> Optional[np.ndarray]:
        """What a hello's progress says was consumed of epoch ``e``, as a bitmap over the stream's records ``k``
        (None: nothing): order 1 sends that bitmap; order 2 ranges of epoch positions, turned into records
        (``consumed_records``: O(the stream), never the dataset)."""
        reported = progress.open.get(e) if progress is not None else None
        if isinstance(reported, PositionRanges):
            return consumed_records(reported, self.key.lazy_order(), e)
        return reported

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
        for epoch in self.open.values():
            epoch.owner[epoch.owner == slot] = FREE
            self.reserved_total += epoch.requeue()

    def on_credit(self, routing_id: bytes, credit: Credit, now: Optional[float] = None) -> bool:
        """Apply a trainer's credit and consumed records; False if it is unknown or of an old session."""
        trainer = self.trainers.on_credit(routing_id, credit, now)
        if trainer is None:
            return False
        slot = self._slots[trainer.id]
        for e, indices in credit.consumed:
            if e < self.completed or not self._may_open(e):
                continue
            self._epoch(e).consume(trainer.id, self.key.local(np.asarray(indices, np.int64)), slot)
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
