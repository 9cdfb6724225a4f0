"""Which connections hold a message, for one reader: one wake-up pipe and a ready queue for all of them (exact
mode's direct links).

A trainer reading 1,024 producers over direct links (``direct_dealer``) had one pipe per link and a
``zmq.Poller`` over all of them, so every receive call scanned 1,024 descriptors however few had a
message. ``ReadyQueue`` keeps instead, for every link sharing it, whether its inbox holds a message:

- ``ready(key)`` (a loop thread, when a link's inbox goes from empty to not empty) queues ``key`` at the back;
- ``drained(key)`` (the reader, when it took a link's last message, or the link closed) takes it out;
- ``take(most)`` (the reader) is the first ``most`` keys, each moved to the back: a link still holding
  messages after its turn waits behind the others (round robin: the one read longest ago first, so a
  receiver with room for one batch a turn reads every producer in turn, never the first alone).

The wake-up pipe (``pollable``, for a ``zmq.Poller``) holds one byte exactly while the queue is not empty,
so a reader waits on one descriptor however many links share it. Every call costs what it takes or changes
(O(1) per key), never the number of links. Thread-safe.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from itertools import islice
from typing import Hashable, Optional


class ReadyQueue:
    """See the module doc. ``close()`` closes the pipe (after the last link sharing it closed)."""

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    @property
    def pollable(self) -> int:
        """Readable exactly while some key is queued."""
        return self._r

    def ready(self, key: Hashable) -> None:
        """``key`` holds a message (again): queued at the back if not queued yet."""
        with self._lock:
            if key in self._keys or self._closed:
                return
            if not self._keys:
                os.write(self._w, b"\0")
            self._keys[key] = None

    def drained(self, key: Hashable) -> None:
        """``key`` holds no message any more (or is gone)."""
        with self._lock:
            if self._keys.pop(key, False) is None and not self._keys and not self._closed:
                os.read(self._r, 1)

    def take(self, most: Optional[int] = None) -> list[Hashable]:
        """Up to ``most`` queued keys (None: all), oldest first, each moved to the back: a key stays queued until
        ``drained``."""
        with self._lock:
            keys = list(islice(self._keys, most)) if most is not None else list(self._keys)
            for key in keys:
                self._keys.move_to_end(key)
        return keys

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._keys.clear()
                os.close(self._r)
                os.close(self._w)
