"""One open epoch of a fixed shard as ``FixedShardPolicy`` keeps it: who holds each record, what is done.

Positions ``k`` index the shard's records (``StreamKey.local``). Each has an ``owner``: ``FREE``, ``MAKING``
(chosen for a batch a worker is making) or the slot of the trainer holding it; and two done marks,
``consumed`` (by any trainer, the union of ``by_trainer``) and ``skipped`` (bad data). The first pass walks
``order`` with ``cursor``; ``lost`` are positions to serve again before it goes on. Logic only, no clock, no
sockets; the policy's one thread drives it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

FREE, MAKING = -1, -2  # owner codes besides a trainer's slot number


@dataclass
class ShardEpoch:
    order: np.ndarray  # shard positions k in this epoch's serving order
    consumed: np.ndarray  # bool [size]: consumed by any trainer
    skipped: np.ndarray  # bool [size]: failed (bad record or sample), done
    owner: np.ndarray  # int32 [size]: FREE, MAKING or the slot of the trainer holding it
    cursor: int = 0  # first-pass position
    lost: deque = field(default_factory=deque)  # positions to serve again, before the first pass goes on
    by_trainer: dict[str, np.ndarray] = field(default_factory=dict)
    left: int = -1  # records neither consumed nor skipped (-1: count them); kept per message, not per epoch scan

    @classmethod
    def fresh(cls, order: np.ndarray, size: int) -> ShardEpoch:
        """An epoch served in ``order``, nothing of it consumed, skipped or held."""
        return cls(order, np.zeros(size, bool), np.zeros(size, bool), np.full(size, FREE, np.int32))

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

    # ---- choosing records ------------------------------------------------------------------

    def take_lost(self, need: int) -> list[int]:
        """Up to ``need`` lost positions still servable, now ``MAKING``."""
        taken: list[int] = []
        while self.lost and len(taken) < need:
            k = self.lost.popleft()
            if self.owner[k] == FREE and not self.consumed[k] and not self.skipped[k]:
                self.owner[k] = MAKING
                taken.append(k)
        return taken

    def take_first_pass(self, need: int) -> np.ndarray:
        """Up to ``need`` servable positions of the first pass, in order, now ``MAKING``; the cursor moves past them."""
        # A window at a time: one record at a time costs ~1 us each in NumPy scalars.
        window = self.order[self.cursor:self.cursor + max(2 * need, 64)]
        free = np.flatnonzero((self.owner[window] == FREE) & ~self.consumed[window] & ~self.skipped[window])[:need]
        self.cursor += int(free[-1]) + 1 if len(free) == need else len(window)
        ks = window[free]
        self.owner[ks] = MAKING
        return ks

    @property
    def first_pass_done(self) -> bool:
        return self.cursor >= len(self.order)

    def requeue(self) -> int:
        """Positions the first pass has passed that nobody consumed, skipped or holds: queued to be served again.
        Returns how many were newly queued."""
        passed = self.order[: self.cursor]
        free = passed[(self.owner[passed] == FREE) & ~self.consumed[passed] & ~self.skipped[passed]]
        queued = set(self.lost)
        added = 0
        for k in free:
            if int(k) not in queued:
                self.lost.append(int(k))
                added += 1
        return added

    def unmake(self, ks: np.ndarray) -> None:
        """Positions chosen for a batch that will not be made (its worker died): free, and served again first."""
        ks = ks[self.owner[ks] == MAKING]
        self.owner[ks] = FREE
        self.lost.extend(int(k) for k in ks)

    # ---- what trainers report --------------------------------------------------------------

    def adopt_consumed(self, trainer: str, reported: np.ndarray | None) -> None:
        """``trainer``'s hello reported these consumed positions (None: none in this epoch): they replace what it
        reported before, and ``consumed`` is rebuilt from every trainer's."""
        previous = self.by_trainer.get(trainer)
        if reported is not None:
            self.by_trainer[trainer] = reported.copy()
        else:
            self.by_trainer.pop(trainer, None)
        if previous is not None or reported is not None:
            self.consumed = np.zeros_like(self.consumed)
            for consumed in self.by_trainer.values():
                self.consumed |= consumed
            self.left = -1

    def consume(self, trainer: str, ks: np.ndarray, slot: int) -> None:
        """``trainer`` (owner code ``slot``) consumed positions ``ks``: done, and no longer held by it."""
        mine = self.by_trainer.get(trainer)
        if mine is None:  # not setdefault: that would allocate a bitmap of the whole shard per message
            mine = self.by_trainer[trainer] = np.zeros_like(self.consumed)
        mine[ks] = True
        self.settle(self.consumed, ks)
        held = ks[self.owner[ks] == slot]
        self.owner[held] = FREE
