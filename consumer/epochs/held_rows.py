"""Batches taken from the queue and not yet handed out, split where an epoch ends.

A producer fills every batch, so a batch may carry the last records of epoch ``e`` and the first of ``e + 1``
(and an elastic pool may deliver a later epoch's records before this one's last). Iterating one epoch at a time,
the rows of epoch ``e`` (or older) are handed out now and the rows of later epochs are *held back*, in arrival
order, for the next epoch's iterator; nothing is dropped or repeated. A part is a batch of fewer rows (exact mode's
batches vary in size already: padding rows are cut off). Rows count as consumed only when they are handed out.

``Rows`` says which records a batch's rows are (aligned with its rows; padding rows already cut off), so the
split needs no look at the batch's own ``epoch`` column (which may live on a GPU). ``select(batch, positions)``
takes rows of a batch of any framework (NumPy and torch index alike: ``{k: v[positions]}``).
Not thread-safe: one epoch iterator at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from stoker.protocol.batch_spec import BatchSpec


@dataclass(frozen=True)
class Rows:
    """The records of a batch's rows, row by row: from producer ``source`` (its ``stoker_source``), of ``epochs``,
    dataset ``indices``."""

    source: int
    epochs: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)

    def select(self, positions: np.ndarray) -> "Rows":
        return Rows(self.source, self.epochs[positions], self.indices[positions])

    @property
    def mask(self) -> np.ndarray:
        """Every row is a record (the ledger's ``consumed`` takes a mask)."""
        return np.ones(len(self.indices), bool)


def select_rows(batch: dict[str, Any], positions: np.ndarray) -> dict[str, Any]:
    """The rows ``positions`` of a batch of NumPy arrays or torch tensors (a copy)."""
    return {name: array[positions] for name, array in batch.items()}


class HeldBatches:
    """See the module doc. ``add`` what the queue gave, ``take(e)`` the next part of epoch ``e`` or older."""

    def __init__(self, select: Callable[[Any, np.ndarray], Any] = select_rows) -> None:
        self._select = select
        self._items: deque[tuple[Any, Rows]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, batch: Any, rows: Rows) -> None:
        """Hold a batch taken from the queue (one with no rows, all padding, holds nothing: nothing to consume)."""
        if len(rows):
            self._items.append((batch, rows))

    def take(self, epoch: int) -> Optional[tuple[Any, Rows]]:
        """The first held batch with rows of ``epoch`` or older, cut to those rows (the rest stays held, in
        place); None if no held row is of ``epoch`` or older."""
        for at, (batch, rows) in enumerate(self._items):
            now = rows.epochs <= epoch
            if not now.any():
                continue
            if now.all():
                del self._items[at]
                return batch, rows
            later = np.flatnonzero(~now)
            self._items[at] = (self._select(batch, later), rows.select(later))
            positions = np.flatnonzero(now)
            return self._select(batch, positions), rows.select(positions)
        return None


def padding_arrays(spec: BatchSpec, epoch: int) -> dict[str, np.ndarray]:
    """A one-row batch of ``spec`` that is no record: zeros, ``index`` -1, ``epoch`` ``epoch``, ``mask`` False. A
    rank whose share of an epoch ran out steps on it while others still train (weight the loss by ``mask``)."""
    batch = {a.name: np.zeros((1, *a.shape[1:]), a.dtype) for a in spec.arrays}
    if "index" in batch:
        batch["index"][:] = -1
    if "epoch" in batch:
        batch["epoch"][:] = epoch
    return batch
