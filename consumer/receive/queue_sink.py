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

import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from stoker.consumer.receive.contract import POLL_S, SinkClosed, aligned_empty

END = object()  # no batch follows: a finite exact run ended (``QueueSink.take``, ``InputBase._take_batch``)


class QueueSink:
    """A ``BatchSink`` holding at most ``capacity`` batches (lists of arrays); see the module doc.

    The batches wait in a ``queue.SimpleQueue``, whose ``get`` waits in C: a consumer waiting for data is woken
    without Python's ``Condition`` machinery, which cost a starved trainer more than the rest of a hand-over.
    A count under one lock bounds them; only a ``put`` waiting for room waits on a condition."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room = threading.Condition(threading.Lock())
        self._held = 0  # batches put and not yet taken (END not counted); written under ``_room``
        self._waiting = 0  # puts waiting for room
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
        with self._room:
            while self._held >= self.capacity and not self._closed:
                self._waiting += 1
                try:
                    self._room.wait(POLL_S)
                finally:
                    self._waiting -= 1
            if self._closed:
                raise SinkClosed()
            self._held += 1
            self._items.put(item)

    def put_now(self, arrays: Sequence[np.ndarray], owned: bool, before: Callable[[], None]) -> bool:
        """``put`` if there is room now, else False (nothing done). ``before`` runs once room is certain, before the
        batch can be taken (what must count it first: the receive core's stats). SinkClosed once closed."""
        item = self.owned(arrays, owned)  # first: nothing is counted for a batch that cannot be kept
        with self._room:
            if self._closed:
                raise SinkClosed()
            if self._held >= self.capacity or self._waiting:  # never ahead of a put already waiting for room
                return False
            before()
            self._held += 1
            self._items.put(item)
            return True

    def size(self) -> int:
        return self._held

    def end(self) -> None:
        self._items.put(END)  # past capacity: the marker takes no batch's room; after every batch put before it

    def close(self, cancel: bool) -> None:
        with self._room:
            self._closed = True
            self._room.notify_all()

    def take(self, timeout: float) -> Any:
        """The next batch (a list of arrays), ``END``, or None if nothing came within ``timeout``."""
        try:
            item = self._items.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if item is not END:
            with self._room:
                self._held -= 1
                if self._waiting:
                    self._room.notify()
        return item
