"""``consumed_when="marked"``: a batch's records count as consumed when the caller marks its step started.

For loops that fetch ahead of the step (PyTorch Lightning takes the next batch before the step ends, so a checkpoint
taken then would count a batch never trained on). The facade hands out batches as usual; ``MarkedConsumption``
holds each one's ``Rows`` until ``mark()`` (once per batch, in the order they were handed out). A batch handed out
and not marked also counts once the facade has to wait for the next one (``count_outstanding``: the loop holds it
and is about to train it; the pool's epoch window and a finite run's end may be waiting for exactly its records);
its ``mark()`` then marks nothing new. The ledger stays the one writer: this only decides when to call it.
"""

from __future__ import annotations

import threading
from collections import deque

from stoker.consumer.epochs.held_rows import Rows
from stoker.consumer.exact.ledger import ConsumedLedger

#: batches handed out and not marked before the facade refuses the next (a forgotten mark_consumed)
MAX_UNMARKED = 64


class MarkedConsumption:
    """The batches handed out and not yet marked consumed, for one input; see the module doc. Thread-safe: a mark
    never waits for a blocked ``next()``."""

    def __init__(self, ledger: ConsumedLedger) -> None:
        self._ledger = ledger
        self._unmarked: deque[Rows] = deque()  # handed out, not yet marked consumed
        self._premarked = 0  # of those, counted consumed when the facade had to wait: their mark() is owed
        self._lock = threading.Lock()

    def check_room(self) -> None:
        """RuntimeError once ``MAX_UNMARKED`` batches were handed out and none marked (before handing out more)."""
        if len(self._unmarked) >= MAX_UNMARKED:
            raise RuntimeError(f"{MAX_UNMARKED} batches handed out and none marked consumed: with "
                               "consumed_when='marked', call mark_consumed() as each batch's step starts")

    def handed_out(self, rows: Rows) -> None:
        with self._lock:
            self._unmarked.append(rows)

    def mark(self) -> None:
        """The oldest batch handed out and not yet marked is consumed now. RuntimeError if every one is marked."""
        with self._lock:
            if self._premarked:
                self._premarked -= 1  # counted when the facade had to wait for the batch after it
                return
            if not self._unmarked:
                raise RuntimeError("mark_consumed(): every batch handed out is marked consumed already")
            rows = self._unmarked.popleft()
            if len(rows):  # a padding batch's rows are no records
                self._ledger.consumed(rows.source, rows.epochs, rows.indices, rows.mask)

    def count_outstanding(self) -> None:
        """The facade is about to wait: batches handed out and not marked count as consumed now."""
        with self._lock:
            while self._unmarked:
                rows = self._unmarked.popleft()
                if len(rows):
                    self._ledger.consumed(rows.source, rows.epochs, rows.indices, rows.mask)
                self._premarked += 1
