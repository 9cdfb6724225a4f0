"""What an exact-mode producer serves, as the forwarding thread sees it: one interface, two policies.

    ServingPolicy --which records--> ExactForwarder --batches--> trainers
                  <--hello / credit / work, sent, skipped--

- ``ExactServer`` (exact_server.py): a fixed shard (``--shard I/N``); the producer decides which of its
  records each batch holds and hands any batch to any trainer with credit.
- ``SplitServer`` (split_server.py): an elastic pool (``--shard auto``); trainers hand out splits of
  every epoch (``work``) and each batch is made for the trainer whose splits it holds. Only such a
  policy takes ``work`` (``PoolPolicy``); the forwarder refuses it for a fixed shard.

Both keep their trainers in a ``TrainerRegistry`` (trainer_registry.py). Policies are logic only
(no sockets, clock-injected) and not thread-safe: the forwarding thread alone drives one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from stoker.protocol.exact_messages import Credit, Hello, Status, Work
from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.trainer_registry import TrainerRegistry


@dataclass
class Chunk:
    """Records handed to a worker for one batch: ``epochs[i]``, ``indices[i]`` row by row."""

    epochs: list[int]
    indices: list[int]
    trainer: Optional[bytes] = None  # an elastic pool's batch is made for one trainer (split_server.py)
    session: int = 0
    generation: int = -1  # ExactServer.generation when its records were chosen

    def __len__(self) -> int:
        return len(self.indices)


class ServingPolicy(Protocol):
    """What the forwarding thread (exact_forwarder.py) and the daemon ask of a serving policy."""

    #: The stream its batches and statuses name (``I/N:count:seed`` or ``splits:count:seed``).
    key: StreamKey
    #: Set when a status should go to every trainer now (an epoch completed, a trainer joined...); the
    #: forwarder clears it when it sends them.
    status_changed: bool

    @property
    def trainers(self) -> TrainerRegistry:
        """The trainers it serves: sessions, credit, liveness (the forwarder expires and drops them there)."""
        ...

    @property
    def finished(self) -> bool:
        """The run is over (``--epochs``): nothing more will be served."""
        ...

    def on_hello(self, routing_id: bytes, hello: Hello, now: Optional[float] = None) -> None:
        """A trainer (re)joined: what it held or asked for under an earlier session is void."""
        ...

    def on_credit(self, routing_id: bytes, credit: Credit, now: Optional[float] = None) -> bool:
        """A trainer's credit (and consumed records); False if it is unknown or of an old session."""
        ...

    def next_chunk(self, n: int) -> Optional[Chunk]:
        """Up to ``n`` records for a worker's next batch (None: nothing to serve now)."""
        ...

    def on_unsent(self, chunk: Chunk) -> None:
        """A chunk will not be made (its worker died): its records are servable again."""
        ...

    def route(self, chunk: Optional[Chunk]) -> Optional[bytes]:
        """The trainer a made batch goes to now (None: it waits for credit)."""
        ...

    def wanted(self, chunk: Optional[Chunk], epochs: np.ndarray, indices: np.ndarray,
               valid: np.ndarray) -> Optional[np.ndarray]:
        """Just before a made batch is sent: the rows (bool per row) its trainer still wants.

        ``valid`` are its rows that hold a sample (``mask``). The forwarder masks valid rows that are not
        wanted (so no record goes out twice) and sends the batch only if some row is wanted. None: the
        whole batch is void (made for a trainer that left or said hello again since).
        """
        ...

    def on_sent(self, routing_id: bytes, epochs: list[int], indices: list[int], chunk: Optional[Chunk] = None) -> None:
        """A batch with these samples went to the trainer at ``routing_id`` (one credit spent)."""
        ...

    def on_skipped(self, epochs: list[int], indices: list[int]) -> None:
        """These records failed (bad data): done, never served again."""
        ...

    def status(self) -> Status:
        """The status to send (the forwarder sets the addressed trainer's ``session`` and ``stranger``)."""
        ...

    def summary(self) -> str:
        """What the run skipped (and served again), for the daemon's last log line."""
        ...


@runtime_checkable
class PoolPolicy(ServingPolicy, Protocol):
    """A policy whose trainers hand out its work: an elastic pool's (``--shard auto``)."""

    def on_work(self, routing_id: bytes, work: Work, now: Optional[float] = None) -> bool:
        """Queue a trainer's splits; False if it is unknown or of an old session. ProtocolError for a bad split."""
        ...
