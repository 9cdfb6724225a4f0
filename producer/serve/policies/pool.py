"""What a producer of an elastic pool serves (``--shard auto``): the splits trainers hand it. Logic only.

In an elastic pool no producer owns a shard. Each trainer owns the input state and hands
out *splits* of every epoch (``work`` messages: positions ``start..end-1`` of the epoch's
order of the whole dataset, less what it already has) to whichever producers are there,
and takes back the splits of a producer that left (consumer/exact/pool/split_scheduler.py). This
policy keeps, per trainer, the records still to make from its splits, and:

- ``next_chunk(n)`` picks up to ``n`` records of one trainer's splits, round-robin over
  trainers with splits to serve and credit to spare (each batch is made for one trainer);
  up to ``make_ahead`` batches (one per worker) beyond a trainer's credit may be in the
  making, so workers go on while credit comes back (in steps of half the trainer's window)
  rather than idle; such a batch waits in its slot until the credit comes;
- ``route(chunk)`` names the trainer a made batch goes to; ``gone(chunk)`` says its trainer
  left or said hello again since (a restart: it hands out its splits afresh), and then the
  batch is void (``wanted`` is None) and not sent;
- ``on_hello`` (re)registers a trainer and drops what it asked for before; ``on_work``
  queues splits (ProtocolError for splits outside the dataset); ``on_credit`` adds credit.
  Trainers live in a ``TrainerRegistry`` (``trainers``), which forgets silent or unreachable ones.

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
from typing import Callable, Optional, Protocol

import numpy as np

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import MAX_SPLIT, Credit, Hello, Status, Work
from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.policies.serving_policy import Chunk
from stoker.producer.serve.policies.exact_policy import TrainerFacingPolicy, no_storage_wait
from stoker.producer.serve.policies.trainer_registry import Trainer, TrainerRegistry

_ORDERS_KEPT = 3  # epoch orders cached (a permutation of the dataset each)
MAX_QUEUED = 4 * MAX_SPLIT  # records queued for one trainer


@dataclass
class _PoolTrainer(Trainer):
    queue: deque = field(default_factory=deque)  # (epoch, records not yet handed to a worker)
    making: int = 0  # chunks of it at workers or waiting to be sent
    finished: bool = False


class ShardCacheView(Protocol):
    """What a pool producer asks of its dataset's cache: ``(capacity, held)`` in blocks of its stream's layout, what
    its trainers hand splits by (the daemon's ``block_layout.BlockHoldings`` over its ``ShardedDataset``)."""

    def holdings(self) -> tuple[Optional[int], list[int]]: ...


class PoolPolicy(TrainerFacingPolicy):
    """Serving decisions of an elastic-pool producer (an ``ExactPolicy``); see the module doc. One thread drives it."""

    mode = "pool"

    def __init__(self, key: StreamKey, producer_id: str, epochs: Optional[int] = None, trainer_timeout: float = 10.0,
                 spec: Optional[list[tuple[str, str, list[int]]]] = None, make_ahead: int = 2,
                 cache: Optional[ShardCacheView] = None, say_cache: bool = True,
                 storage: Callable[[], str] = no_storage_wait) -> None:
        if not key.splits:
            raise ValueError(f"stream {key} is not an elastic pool's (splits:count:seed)")
        self.key, self.producer_id, self.epochs = key, producer_id, epochs
        self.make_ahead = make_ahead
        #: this host's shard cache, in blocks (``ShardCacheView``): what it holds is said in each status (unless not
        #: ``say_cache``: ``--shard-affinity off``). Nothing is fetched ahead here: see docs/decisions.md
        self.cache, self.say_cache = cache, say_cache
        self._cache_seen: Optional[tuple[float, tuple[Optional[int], list[int]]]] = None
        self.spec = list(spec or [])
        self.trainers: TrainerRegistry[_PoolTrainer] = TrainerRegistry(trainer_timeout, self._forget)
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pending: set[str] = set()  # trainers known and not finished
        self._any_finished = False
        self.skipped_total = 0
        self._status_changed = False
        self.storage = storage

    # ---- what the trainers ask for ---------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = self.key.order(epoch)
            while len(self._orders) > _ORDERS_KEPT:
                self._orders.popitem(last=False)
        self._orders.move_to_end(epoch)
        return self._orders[epoch]

    def _records_at(self, epoch: int, start: int, end: int) -> np.ndarray:
        """The records at positions ``[start, end)`` of ``epoch``: computed for just those in epoch order 2 (lazy),
        cut from the cached whole order in order 1 (a copy: the order may be evicted)."""
        if self.key.order_version == 2:
            return self.key.lazy_order().records(epoch, start, end)
        return self._order(epoch)[start:end].copy()

    def on_hello(self, routing_id: bytes, hello: Hello, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        # A reconnect or a restart: what it asked for before is void (its queue goes with its old record).
        self.trainers.join(_PoolTrainer(hello.trainer, routing_id, hello.session, hello.credit, now))
        self._pending.add(hello.trainer)
        self._status_changed = True

    def on_work(self, routing_id: bytes, work: Work, now: Optional[float] = None) -> bool:
        """Queue a trainer's splits; False if it is unknown or of an old session. ProtocolError for a bad split."""
        trainer = self.trainers.heard(routing_id, work.session, now)
        if trainer is None:
            return False
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
            records = self._records_at(item.epoch, item.start, item.end)
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
            self._status_changed = True
        return True

    def on_credit(self, routing_id: bytes, credit: Credit, now: Optional[float] = None) -> bool:
        return self.trainers.on_credit(routing_id, credit, now) is not None

    # ---- work ------------------------------------------------------------------------------

    def next_chunk(self, n: int) -> Optional[Chunk]:
        """Up to ``n`` records of one trainer's splits (None: nothing to serve now)."""
        routing_id = self.trainers.pick(lambda t: bool(t.queue) and t.credit + self.make_ahead - t.making > 0)
        trainer = self.trainers.get(routing_id)
        if trainer is None:
            return None
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

    def _owner(self, chunk: Chunk) -> Optional[_PoolTrainer]:
        """The trainer a chunk was made for, if it is still there under the same session."""
        trainer = self.trainers.get(chunk.trainer)
        return trainer if trainer is not None and trainer.session == chunk.session else None

    def _done_making(self, chunk: Chunk) -> None:
        trainer = self._owner(chunk)
        if trainer is not None:
            trainer.making = max(0, trainer.making - 1)

    def on_unsent(self, chunk: Chunk) -> None:
        """A chunk will not be sent (its worker died): its records go back to the front of its trainer's queue."""
        self._done_making(chunk)
        trainer = self._owner(chunk)
        if trainer is not None:
            for epoch in sorted(set(chunk.epochs), reverse=True):
                rows = [i for e, i in zip(chunk.epochs, chunk.indices) if e == epoch]
                trainer.queue.appendleft((epoch, np.asarray(rows, np.int64)))

    def gone(self, chunk: Chunk) -> bool:
        """Whether the trainer a made chunk is for left or said hello again since (then the batch is not sent)."""
        return self._owner(chunk) is None

    def route(self, chunk: Optional[Chunk]) -> Optional[bytes]:
        """The trainer a made batch goes to: its own, once it has credit; a gone one at once (``wanted`` then says
        the batch is void)."""
        if chunk is None or chunk.trainer is None:
            return None
        trainer = self._owner(chunk)
        return chunk.trainer if trainer is None or trainer.credit > 0 else None

    def wanted(self, chunk: Optional[Chunk], epochs: np.ndarray, indices: np.ndarray,
               valid: np.ndarray) -> Optional[np.ndarray]:
        """Every row with a record, failed ones too (the trainer learns of them from the batch); which records it
        already has is the trainer's to decide. None if the chunk's trainer is ``gone``."""
        if chunk is None or self.gone(chunk):
            return None
        return indices >= 0

    def on_sent(self, routing_id: bytes, epochs: list[int], indices: list[int], chunk: Optional[Chunk] = None) -> None:
        self.trainers.spend(routing_id)
        if chunk is not None:
            self._done_making(chunk)

    def on_skipped(self, epochs: list[int], indices: list[int]) -> None:
        """Records that failed (bad data): the trainer learns it from the batch (masked rows with an index)."""
        self.skipped_total += len(indices)

    # ---- trainers --------------------------------------------------------------------------

    def _forget(self, trainer: _PoolTrainer) -> None:
        """A trainer left the registry (gone, or back under a new session): its splits are its to hand out again.
        A ``--epochs`` producer does not wait for a trainer that died to say it finished."""
        if not self.trainers.knows(trainer.id):
            self._pending.discard(trainer.id)

    @property
    def finished(self) -> bool:
        return self.epochs is not None and self._any_finished and not self._pending

    def _cache(self) -> tuple[Optional[int], list[int]]:
        """This host's cache, looked at most once a second (a status goes to every trainer every second)."""
        now = time.monotonic()
        if self._cache_seen is None or now - self._cache_seen[0] >= 1.0:
            self._cache_seen = (now, self.cache.holdings() if self.cache is not None else (None, []))
        return self._cache_seen[1]

    def status(self, to: bytes = b"", stranger: bool = False) -> Status:
        capacity, held = self._cache() if self.key.block and self.say_cache else (None, [])
        return self._addressed(Status(str(self.key), self.producer_id, 0, self.epochs, self.finished, self.spec, 0,
                                      cache=capacity, held=held, skipped=self.skipped_total), to, stranger)

    def summary(self) -> str:
        return f"{self.skipped_total} records skipped"
