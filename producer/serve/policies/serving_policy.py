"""What the daemon and the forwarding thread ask of a serving policy: the interfaces every policy answers.

    daemon --policy_for(config)--> a ServingPolicy --forwarder()--> the forwarding thread
    ExactPolicy --which records--> ExactForwarder --batches--> trainers
                <--hello / credit / work, sent, skipped--

- ``PlainPolicy`` (plain.py): no trainer known, no record chosen: each worker runs its deterministic stream and
  the PUSH socket hands each batch to whichever trainer is ready (``SlotForwarder``).
- ``FixedShardPolicy`` (fixed_shards.py): a fixed shard in exact mode (``--shard I/N``); the producer decides
  which of its records each batch holds and hands any batch to any trainer with credit.
- ``PoolPolicy`` (pool.py): an elastic pool (``--shard auto``); trainers hand out splits of every epoch
  (``work``) and each batch is made for the trainer whose splits it holds. A fixed shard refuses ``work``.

The exact ones keep their trainers in a ``TrainerRegistry`` (trainer_registry.py) and own their status (what
goes to each trainer, and when it should go to all). Policies decide only (no sockets, clock-injected) and are
not thread-safe: the forwarding thread alone drives one. ``policy_for`` (choice.py) picks one for a daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from stoker.protocol.exact_messages import Credit, Hello, Status, Work
from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.forwarder import SlotForwarder
from stoker.producer.serve.policies.trainer_registry import TrainerRegistry


@dataclass
class Chunk:
    """Records handed to a worker for one batch: ``epochs[i]``, ``indices[i]`` row by row."""

    epochs: list[int]
    indices: list[int]
    trainer: Optional[bytes] = None  # an elastic pool's batch is made for one trainer (pool.py)
    session: int = 0
    generation: int = -1  # FixedShardPolicy.generation when its records were chosen

    def __len__(self) -> int:
        return len(self.indices)


class ServingPolicy(Protocol):
    """What the daemon asks of every serving policy, plain included."""

    #: The status file's ``mode``: ``plain``, ``exact`` or ``pool``.
    mode: str

    def forwarder(self, control: Any, out: Any, layout: Any, buffers: list[Any]) -> SlotForwarder:
        """The forwarding thread's job that drives this policy over the workers' ``control`` and the trainers' ``out``."""
        ...

    def summary(self) -> str:
        """What the run skipped (and served again), for the daemon's "finished" log line."""
        ...

    def trainer_counts(self) -> dict[str, int]:
        """For the stop summary: trainers that said goodbye (``goodbyes``) and those lost without one
        (``trainers_lost``); none for a policy that knows no trainers."""
        ...


class ExactPolicy(ServingPolicy, Protocol):
    """What the exact forwarding thread (exact_forwarder.py) asks of an exact-mode policy."""

    #: The stream its batches and statuses name (``I/N:count:seed`` or ``splits:count:seed``).
    key: StreamKey

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

    def on_work(self, routing_id: bytes, work: Work, now: Optional[float] = None) -> bool:
        """Queue a trainer's splits; False if it is unknown or of an old session. ProtocolError for work it
        refuses (a bad split; any work at all for a fixed shard)."""
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

    def status(self, to: bytes = b"", stranger: bool = False) -> Status:
        """The status for the trainer at routing id ``to`` (its session; 0 for one that has not joined, or no
        one); ``stranger``: the answer to credit or work from a trainer it does not know (say hello again)."""
        ...

    def take_status_change(self) -> bool:
        """Whether a status should go to every trainer now (an epoch completed, a trainer joined...); asking
        clears it."""
        ...
