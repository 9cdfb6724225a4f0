"""What the exact-mode policies share: their forwarding thread, their trainers' counts, their status's addressing.

``FixedShardPolicy`` and ``PoolPolicy`` subclass ``TrainerFacingPolicy``; each builds its own ``Status`` and
``_addressed`` adds what depends on the trainer it goes to and on the workers (the session, ``stranger``, object
storage's wait). Each owns its ``_status_changed`` flag; the forwarder asks ``take_status_change()``.
"""

from __future__ import annotations

from typing import Any, Callable

from stoker.protocol.exact_messages import Status

from stoker.producer.serve.exact_forwarder import ExactForwarder
from stoker.producer.serve.policies.trainer_registry import TrainerRegistry


def no_storage_wait() -> str:
    """The default ``storage``: no worker waits on object storage."""
    return ""


class TrainerFacingPolicy:
    """The shared half of an exact-mode policy (``ExactPolicy``, serving_policy.py); subclasses set ``trainers``,
    ``storage`` and ``_status_changed`` in their constructor."""

    mode = "exact"
    trainers: TrainerRegistry
    #: what its workers wait on object storage for, "" if nothing (``StageStats.storage_waiting``): said in each
    #: status, so a trainer blames storage, not this producer, for a stall
    storage: Callable[[], str]
    _status_changed: bool

    def forwarder(self, control: Any, out: Any, layout: Any, buffers: list[Any]) -> ExactForwarder:
        return ExactForwarder(control, out, layout, buffers, self)  # type: ignore[arg-type]

    def trainer_counts(self) -> dict[str, int]:
        return {"goodbyes": self.trainers.goodbyes, "trainers_lost": self.trainers.lost}

    def take_status_change(self) -> bool:
        changed, self._status_changed = self._status_changed, False
        return changed

    def _addressed(self, status: Status, to: bytes, stranger: bool) -> Status:
        status.session = self.trainers.session_of(to)  # 0: it has not joined (a describe), or no one
        status.stranger = stranger
        status.goodbye = True  # this producer takes a trainer's goodbye (ExactForwarder._on_goodbye)
        status.storage = self.storage()
        return status
