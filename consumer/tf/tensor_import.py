"""Received arrays into TensorFlow with one copy: into aligned memory TensorFlow then takes without copying.

A received frame lives in libzmq's memory, only 8-byte aligned (message data follows
a 40-byte header in one malloc); TensorFlow maps tensors with aligned Eigen maps and
aborts the process on an unaligned one (``Check failed: IsAligned()``), and its DLPack
import does not check, so a frame cannot be handed to TensorFlow as it is. ``TensorImporter.to_tensor`` copies a
large array once into a 64-byte-aligned buffer of its own and imports that buffer
with DLPack (no second copy; ``tf.convert_to_tensor`` copies too and costs about 40 us
more per array, labels and indices included). The buffers are pooled per size: one
goes back to the pool when TensorFlow frees the tensor (the DLPack capsule owns the
numpy array, whose finaliser returns it), so steady state allocates nothing and
touches no fresh pages.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import defaultdict

import numpy as np
import tensorflow as tf

ALIGN = 64


class TensorImporter:
    """Turns numpy arrays into eager CPU tensors with one copy; see the module doc. Thread-safe."""

    def __init__(self, max_pooled_bytes: int = 2 * 1024**3) -> None:
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()
        self._pooled = 0
        self._max_pooled = max_pooled_bytes
        # Released buffers arrive here from finalizers, which may run on any thread, also on one that
        # holds self._lock (a garbage collection inside _buffer): so releasing takes no lock.
        self._released: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()

    def _reclaim(self) -> None:
        """Move released buffers into the pool (caller holds ``self._lock``)."""
        while True:
            try:
                buffer = self._released.get_nowait()
            except queue.Empty:
                return
            if self._pooled + buffer.nbytes <= self._max_pooled:
                self._free[buffer.nbytes].append(buffer)
                self._pooled += buffer.nbytes

    def _buffer(self, nbytes: int) -> np.ndarray:
        with self._lock:
            self._reclaim()
            free = self._free.get(nbytes)
            if free:
                self._pooled -= nbytes
                return free.pop()
        raw = np.empty(nbytes + ALIGN, np.uint8)
        offset = (-raw.ctypes.data) % ALIGN
        return raw[offset : offset + nbytes]

    def _release(self, buffer: np.ndarray) -> None:
        self._released.put(buffer)  # SimpleQueue.put is safe in weakref callbacks and finalizers

    @property
    def pooled_bytes(self) -> int:
        """Bytes of free buffers waiting for reuse (at most ``max_pooled_bytes``)."""
        with self._lock:
            self._reclaim()
            return self._pooled

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A pooled, 64-byte-aligned array for the caller to fill, then pass to ``own``.

        Its buffer returns to the pool when the array (or the tensor ``own`` made of it) is freed.
        """
        buffer = self._buffer(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        owner = buffer.view(dtype).reshape(shape)
        weakref.finalize(owner, self._release, buffer)
        return owner

    @staticmethod
    def own(array: np.ndarray) -> tf.Tensor:
        """An array from ``empty`` as a tensor TensorFlow owns, without copying (DLPack)."""
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())

    def to_tensor(self, array: np.ndarray) -> tf.Tensor:
        """``array`` as a tensor TensorFlow owns (``array`` may be reused or freed afterwards)."""
        if array.nbytes == 0:  # nothing to copy or pool
            return tf.convert_to_tensor(array)
        owner = self.empty(array.dtype, array.shape)
        np.copyto(owner, array)
        return self.own(owner)
