"""What a producer of an elastic pool serves (``--shard auto``): the splits trainers hand it. Logic only.

In an elastic pool no producer owns a shard. Each trainer owns the input state and hands
out *splits* of every epoch (``work`` messages: positions ``start..end-1`` of the epoch's
order of the whole dataset, less what it already has) to whichever producers are there,
and takes back the splits of a producer that left (consumer/exact/split_scheduler.py). This
server keeps, per trainer, the records still to make from its splits, and:

- ``next_chunk(n)`` picks up to ``n`` records of one trainer's splits, round-robin over
  trainers with splits to serve and credit to spare (each batch is made for one trainer);
  up to ``make_ahead`` batches (one per worker) beyond a trainer's credit may be in the
  making, so workers go on while credit comes back (in steps of half the trainer's window)
  rather than idle; such a batch waits in its slot until the credit comes;
- ``route(chunk)`` names the trainer a made batch goes to; ``gone(chunk)`` says its trainer
  left or said hello again since (a restart: it hands out its splits afresh), and then the
  batch is not sent (``forget``);
- ``on_hello`` (re)registers a trainer and drops what it asked for before; ``on_work``
  queues splits (ProtocolError for splits outside the dataset); ``on_credit`` adds credit;
  ``expire``/``drop`` forget silent or unreachable trainers.

The records a producer serves are exactly the splits' records: nothing here decides
exactness, which the trainer keeps (it drops a record it already has, so a split handed
out twice, to a producer taken for dead that was not, costs work, never a duplicate).
``finished`` (``--epochs``) once a trainer said it has its whole run and every other known trainer
did too or is gone. What one trainer can make a producer hold is bounded (``MAX_QUEUED`` records,
two epoch orders per message); anything beyond is refused with ProtocolError, counted by the caller.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import MAX_SPLIT, Credit, Hello, Status, Work
from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.exact_server import Chunk
from stoker.producer.serve.sharding import epoch_order

_ORDERS_KEPT = 3  # epoch orders cached (a permutation of the dataset each)
MAX_QUEUED = 4 * MAX_SPLIT  # records queued for one trainer


@dataclass
class _Trainer:
    id: str
    session: int
    credit: int
    last_seen: float
    queue: deque = field(default_factory=deque)  # (epoch, records not yet handed to a worker)
    making: int = 0  # chunks of it at workers or waiting to be sent
    finished: bool = False


class SplitServer:
    """Serving decisions of an elastic-pool producer; see the module doc. One thread drives it."""

    def __init__(self, key: StreamKey, producer_id: str, epochs: Optional[int] = None, trainer_timeout: float = 10.0,
                 spec: Optional[list[tuple[str, str, list[int]]]] = None, make_ahead: int = 2) -> None:
        if not key.splits:
            raise ValueError(f"stream {key} is not an elastic pool's (splits:count:seed)")
        self.key, self.producer_id, self.epochs, self.trainer_timeout = key, producer_id, epochs, trainer_timeout
        self.make_ahead = make_ahead
        self.spec = list(spec or [])
        self.trainers: dict[bytes, _Trainer] = {}
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._rotation = 0
        self._pending: set[str] = set()  # trainers known and not finished
        self._any_finished = False
        self.completed = 0  # epochs are the trainers' to count; kept for the forwarder's log line
        self.skipped_total = 0
        self.reserved_total = 0
        self.status_changed = False

    # ---- what the trainers ask for ---------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = epoch_order(np.arange(self.key.records, dtype=np.int64), self.key.seed, epoch)
            while len(self._orders) > _ORDERS_KEPT:
                self._orders.popitem(last=False)
        self._orders.move_to_end(epoch)
        return self._orders[epoch]

    def on_hello(self, routing_id: bytes, hello: Hello, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        for old_routing, old in list(self.trainers.items()):
            if old.id == hello.trainer:  # a reconnect or a restart: what it asked for before is void
                del self.trainers[old_routing]
        self.trainers[routing_id] = _Trainer(hello.trainer, hello.session, hello.credit, now)
        self._pending.add(hello.trainer)
        self.status_changed = True

    def on_work(self, routing_id: bytes, work: Work, now: Optional[float] = None) -> bool:
        """Queue a trainer's splits; False if it is unknown or of an old session. ProtocolError for a bad split."""
        trainer = self.trainers.get(routing_id)
        if trainer is None or work.session != trainer.session:
            return False
        trainer.last_seen = time.monotonic() if now is None else now
        for item in work.items:
            if item.end > self.key.records or (self.epochs is not None and item.epoch >= self.epochs):
                raise ProtocolError(f"work asks for positions {item.start}-{item.end} of epoch {item.epoch}, outside "
                                    f"this producer's run ({self.key.records} records, {self.epochs or 'endless'} "
                                    "epochs): trainer and producers must serve the same dataset")
        # Bounds on what one trainer can make this producer hold and compute: records queued, and epoch orders
        # (a permutation of the dataset each) per message; a trainer asks for at most two epochs at a time.
        epochs = {item.epoch for item in work.items}
        if len(epochs) > _ORDERS_KEPT - 1:
            raise ProtocolError(f"work names {len(epochs)} epochs; a trainer hands out at most {_ORDERS_KEPT - 1} "
                                "at a time")
        queued = sum(len(r) for _, r in trainer.queue) + sum(item.end - item.start for item in work.items)
        if queued > MAX_QUEUED:
            raise ProtocolError(f"work would queue {queued} records for trainer {trainer.id}, more than "
                                f"{MAX_QUEUED}: a trainer keeps a few splits ahead, not more")
        for item in work.items:
            records = self._order(item.epoch)[item.start:item.end].copy()  # not a view: the order may be evicted
            if item.skip:
                keep = np.ones(len(records), bool)
                keep[np.asarray(item.skip, np.int64)] = False
                records = records[keep]
            if len(records):
                trainer.queue.append((item.epoch, records))
        if work.finished and not trainer.finished:
            trainer.finished = True
            self._pending.discard(trainer.id)
            self._any_finished = True
            self.status_changed = True
        return True

    def on_credit(self, routing_id: bytes, credit: Credit, now: Optional[float] = None) -> bool:
        trainer = self.trainers.get(routing_id)
        if trainer is None or credit.session != trainer.session:
            return False
        trainer.credit += credit.n
        trainer.last_seen = time.monotonic() if now is None else now
        return True

    # ---- work ------------------------------------------------------------------------------

    def next_chunk(self, n: int) -> Optional[Chunk]:
        """Up to ``n`` records of one trainer's splits (None: nothing to serve now)."""
        ready = [r for r, t in self.trainers.items() if t.queue and t.credit + self.make_ahead - t.making > 0]
        if not ready:
            return None
        self._rotation += 1
        routing_id = ready[self._rotation % len(ready)]
        trainer = self.trainers[routing_id]
        epochs: list[int] = []
        indices: list[int] = []
        while trainer.queue and len(indices) < n:
            epoch, records = trainer.queue[0]
            take = records[: n - len(indices)]
            epochs.extend([epoch] * len(take))
            indices.extend(int(i) for i in take)
            if len(take) == len(records):
                trainer.queue.popleft()
            else:
                trainer.queue[0] = (epoch, records[len(take):])
        trainer.making += 1
        return Chunk(epochs, indices, trainer=routing_id, session=trainer.session)

    def _done_making(self, chunk: Chunk) -> None:
        trainer = self.trainers.get(chunk.trainer) if chunk.trainer is not None else None
        if trainer is not None and trainer.session == chunk.session:
            trainer.making = max(0, trainer.making - 1)

    def on_unsent(self, chunk: Chunk) -> None:
        """A chunk will not be sent (its worker died): its records go back to the front of its trainer's queue."""
        self._done_making(chunk)
        trainer = self.trainers.get(chunk.trainer) if chunk.trainer is not None else None
        if trainer is not None and trainer.session == chunk.session:
            for epoch in sorted(set(chunk.epochs), reverse=True):
                rows = [i for e, i in zip(chunk.epochs, chunk.indices) if e == epoch]
                trainer.queue.appendleft((epoch, np.asarray(rows, np.int64)))

    def gone(self, chunk: Chunk) -> bool:
        """Whether the trainer a made chunk is for left or said hello again since (then the batch is not sent)."""
        trainer = self.trainers.get(chunk.trainer) if chunk.trainer is not None else None
        return trainer is None or trainer.session != chunk.session

    def forget(self, chunk: Chunk) -> None:
        """A made chunk is not sent (its trainer is gone)."""
        self._done_making(chunk)

    def route(self, chunk: Optional[Chunk]) -> Optional[bytes]:
        """The trainer a made batch goes to: its own, once it has credit (a gone one too: the batch is stale)."""
        if chunk is None or chunk.trainer is None:
            return None
        trainer = self.trainers.get(chunk.trainer)
        if trainer is None or trainer.session != chunk.session:
            return chunk.trainer
        return chunk.trainer if trainer.credit > 0 else None

    def take_stale(self, epochs: np.ndarray, indices: np.ndarray, chunk: Optional[Chunk] = None) -> np.ndarray:
        """No row: a batch is made for one trainer, and one whose trainer is ``gone`` is not sent at all; which
        records that trainer already has is its own to decide."""
        return np.zeros(len(indices), bool)

    def on_sent(self, routing_id: bytes, epochs: list[int], indices: list[int], chunk: Optional[Chunk] = None) -> None:
        trainer = self.trainers[routing_id]
        trainer.credit -= 1
        if chunk is not None:
            self._done_making(chunk)

    def on_skipped(self, epochs: list[int], indices: list[int]) -> None:
        """Records that failed (bad data): the trainer learns it from the batch (masked rows with an index)."""
        self.skipped_total += len(indices)

    # ---- trainers --------------------------------------------------------------------------

    def expire(self, now: Optional[float] = None) -> list[str]:
        now = time.monotonic() if now is None else now
        dead = [r for r, t in self.trainers.items() if now - t.last_seen > self.trainer_timeout]
        return [self.drop(r) for r in dead]

    def drop(self, routing_id: bytes) -> str:
        """Forget a trainer that is gone; its splits are its to hand out again. A ``--epochs`` producer does not
        wait for a trainer that died to say it finished."""
        trainer = self.trainers.pop(routing_id)
        if not any(t.id == trainer.id for t in self.trainers.values()):
            self._pending.discard(trainer.id)
        return trainer.id

    def pick_trainer(self) -> Optional[bytes]:
        return None  # every batch is made for one trainer: ``route``

    def session_of(self, routing_id: bytes) -> int:
        return self.trainers[routing_id].session

    @property
    def finished(self) -> bool:
        return self.epochs is not None and self._any_finished and not self._pending

    def status(self) -> Status:
        return Status(str(self.key), self.producer_id, 0, self.epochs, self.finished, self.spec, 0)
