"""QueueSink: the sink an iterable facade takes its batches from, and ``END``, the marker that a finite run ended.

A ``BatchSink`` (``contract.py``) holding at most ``capacity`` batches, each a list of arrays in spec order, that the
facade's consume loop (``InputBase``) takes one at a time. Arrays the receiver read straight into memory from
``empty()`` are kept as they are; views of libzmq's frames (``owned=False``) are copied once into aligned memory
of our own, so every batch handed out belongs to the caller and is never read or written by Stoker again. A
framework's sink subclasses it to receive into its own memory (``torch/pinned_sink.py``).

Bound: at most ``capacity`` batches wait; ``put`` blocks (polling, so ``close`` ends it) while the queue is full;
``put_now`` never blocks (False when full), for a receive loop that hands a batch over itself when there is room.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from stoker.consumer.receive.contract import POLL_S, SinkClosed, aligned_empty

END = object()  # no batch follows: a finite exact run ended (``QueueSink.take``, ``InputBase._take_batch``)


class QueueSink:
    """A ``BatchSink`` holding at most ``capacity`` batches (lists of arrays); see the module doc."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return aligned_empty(dtype, shape)

    def owned(self, arrays: Sequence[np.ndarray], owned: bool) -> list[Any]:
        """The batch as this sink keeps it: arrays from ``empty`` as they are; views of libzmq's frames
        (``owned=False``) copied once into memory the caller will own."""
        if owned:
            return list(arrays)
        copies = []
        for array in arrays:
            owner = aligned_empty(array.dtype, array.shape)
            np.copyto(owner, array)
            copies.append(owner)
        return copies

    def put(self, arrays: Sequence[np.ndarray], owned: bool) -> None:
        item = self.owned(arrays, owned)
        with self._cond:
            while len(self._items) >= self.capacity and not self._closed:
                self._cond.wait(POLL_S)
            if self._closed:
                raise SinkClosed()
            self._items.append(item)
            self._cond.notify_all()

    def put_now(self, arrays: Sequence[np.ndarray], owned: bool, before: Callable[[], None]) -> bool:
        """``put`` if there is room now, else False (nothing done). ``before`` runs once room is certain, before the
        batch can be taken (what must count it first: the receive core's stats). SinkClosed once closed."""
        with self._cond:
            if self._closed:
                raise SinkClosed()
            if len(self._items) >= self.capacity:
                return False
            before()
            self._items.append(self.owned(arrays, owned))
            self._cond.notify_all()
            return True

    def size(self) -> int:
        with self._cond:
            return sum(item is not END for item in self._items)

    def end(self) -> None:
        with self._cond:
            self._items.append(END)  # past capacity: the marker takes no batch's room
            self._cond.notify_all()

    def close(self, cancel: bool) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, timeout: float) -> Any:
        """The next batch (a list of arrays), ``END``, or None if nothing came within ``timeout``."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            if not self._items:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            return item
