"""The trainers an exact-mode producer knows: by routing id, each with its session, credit and when it was last heard.

Both serving policies (``FixedShardPolicy``, ``PoolPolicy``) keep their trainers here; what losing one means
is theirs, given as ``forget``:

- ``join`` registers a trainer's hello; an earlier connection or session of the same trainer (a reconnect,
  a restart) is forgotten first: what it held or asked for is void;
- ``heard`` and ``on_credit`` take a message of a trainer's current session (None for an unknown
  trainer or an old session: the forwarder tells it to say hello again), and ``spend`` a batch sent to it;
- ``expire`` forgets trainers silent for ``timeout`` seconds, ``drop`` one that is unreachable (``lost``
  counts both), ``leave`` one that said goodbye (``goodbyes``);
- ``pick`` chooses round-robin among trainers that are ready (default: those with credit).

Not thread-safe: the forwarding thread alone drives it. Clock-injected (``now``) for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Optional, TypeVar

from stoker.protocol.exact_messages import Credit


@dataclass
class Trainer:
    """One trainer as a producer knows it: its stable id, its connection, the session and credit of its last hello."""

    id: str
    routing_id: bytes
    session: int
    credit: int
    last_seen: float


T = TypeVar("T", bound=Trainer)


def _has_credit(trainer: Trainer) -> bool:
    return trainer.credit > 0


class TrainerRegistry(Generic[T]):
    """See the module doc. ``forget(trainer)`` is called for every trainer that leaves the registry."""

    def __init__(self, timeout: float, forget: Callable[[T], None]) -> None:
        self.timeout = timeout
        self._forget = forget
        self._trainers: dict[bytes, T] = {}
        self._rotation = 0
        self.goodbyes = 0  # trainers that said goodbye (left of their own accord)
        self.lost = 0  # trainers forgotten without one: unreachable, or silent for ``timeout``

    def join(self, trainer: T) -> None:
        """Register ``trainer`` (from its hello) at its routing id, after forgetting its earlier incarnations."""
        for old in [t for t in self._trainers.values() if t.id == trainer.id]:
            del self._trainers[old.routing_id]
            self._forget(old)
        self._trainers[trainer.routing_id] = trainer

    def get(self, routing_id: Optional[bytes]) -> Optional[T]:
        return self._trainers.get(routing_id) if routing_id is not None else None

    def knows(self, trainer_id: str) -> bool:
        """Whether a trainer of this id is registered (at any routing id)."""
        return any(t.id == trainer_id for t in self._trainers.values())

    def session_of(self, routing_id: bytes) -> int:
        """The session of the trainer at ``routing_id``; 0 for one that has not joined (protocol.md, ``status``)."""
        trainer = self._trainers.get(routing_id)
        return trainer.session if trainer is not None else 0

    def heard(self, routing_id: bytes, session: int, now: Optional[float] = None) -> Optional[T]:
        """The trainer a message of ``session`` came from, now marked alive; None if unknown or of an old session."""
        trainer = self._trainers.get(routing_id)
        if trainer is None or session != trainer.session:
            return None
        trainer.last_seen = time.monotonic() if now is None else now
        return trainer

    def on_credit(self, routing_id: bytes, credit: Credit, now: Optional[float] = None) -> Optional[T]:
        """Add a trainer's credit (``heard``); the trainer, or None if unknown or of an old session."""
        trainer = self.heard(routing_id, credit.session, now)
        if trainer is not None:
            trainer.credit += credit.n
        return trainer

    def spend(self, routing_id: bytes) -> T:
        """A batch went to the trainer at ``routing_id``: one credit less."""
        trainer = self._trainers[routing_id]
        trainer.credit -= 1
        return trainer

    def pick(self, ready: Callable[[T], bool] = _has_credit) -> Optional[bytes]:
        """A ready trainer's routing id, round-robin (None: no trainer is ready)."""
        candidates = [r for r, t in self._trainers.items() if ready(t)]
        if not candidates:
            return None
        self._rotation += 1
        return candidates[self._rotation % len(candidates)]

    def expire(self, now: Optional[float] = None) -> list[str]:
        """Forget trainers silent for more than ``timeout`` seconds; their ids."""
        now = time.monotonic() if now is None else now
        dead = [r for r, t in self._trainers.items() if now - t.last_seen > self.timeout]
        return [self.drop(r) for r in dead]

    def drop(self, routing_id: bytes) -> str:
        """Forget the trainer at ``routing_id`` (gone: unreachable or silent); its id."""
        trainer = self._trainers.pop(routing_id)
        self._forget(trainer)
        self.lost += 1
        return trainer.id

    def leave(self, routing_id: bytes, session: int) -> Optional[str]:
        """Forget the trainer at ``routing_id`` that said goodbye under ``session``; its id. None: unknown, or a
        goodbye of an old session (that incarnation is forgotten already)."""
        trainer = self._trainers.get(routing_id)
        if trainer is None or trainer.session != session:
            return None
        del self._trainers[routing_id]
        self._forget(trainer)
        self.goodbyes += 1
        return trainer.id

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._trainers))

    def __len__(self) -> int:
        return len(self._trainers)
