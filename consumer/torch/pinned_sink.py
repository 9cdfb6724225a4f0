"""PinnedSink: batches received straight into torch tensors' memory, pinned where CUDA is available.

Direct receive reads each array into memory the sink's ``empty()`` gives. Here that memory is a fresh
``torch.empty(..., pin_memory=pin)`` tensor, handed to the receiver as a NumPy array over the same bytes
(``tensor.numpy()``): the kernel's copy out of the socket is the only copy, and a pinned tensor travels to a
GPU by DMA, asynchronously. Batches that arrive as libzmq frames (CurveZMQ, exact mode's libzmq links,
``receive="libzmq"``) are copied once into such a tensor. Tensors are 64-byte aligned (torch's CPU allocator) or
page-aligned (pinned).

Ownership, as ``torch.utils.data.DataLoader``: every batch is fresh tensors that belong to the consumer;
the sink never reads or writes them again. Memory is reused by torch's own allocators, not by a pool of
ours: a freed pinned tensor's block goes back to PyTorch's caching host allocator, which hands it out again
only after the copies recorded on it have completed (and ``device_prefetch`` keeps each host batch alive
until its copy's event completed in any case). A pool here would have to track memory a receiver took
for a message it then rejected, and memory the caller kept; handing buffers out only once would buy
nothing the allocator does not already give.

Bound: ``QueueSink``'s, at most ``capacity`` batches wait; the receivers hold one more per producer.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from stoker.consumer.receive.queue_sink import QueueSink


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a NumPy dtype Stoker's protocol allows (every one has a torch twin of the same name)."""
    return getattr(torch, np.dtype(dtype).name)


def tensor_of(array: np.ndarray) -> torch.Tensor:
    """The tensor whose memory ``array`` is: the one ``empty()`` made (its ``numpy()`` keeps it as ``base``),
    else a tensor over the array's memory (an array the core made before the sink existed)."""
    base = array.base
    if (isinstance(base, torch.Tensor) and base.data_ptr() == array.ctypes.data
            and tuple(base.shape) == array.shape and base.is_contiguous()):
        return base
    return torch.from_numpy(array)


class PinnedSink(QueueSink):
    """A ``BatchSink`` of torch tensors (lists, in spec order), at most ``capacity`` waiting; see the module doc.

    ``pin``: allocate pinned (page-locked) host memory, for asynchronous copies to a CUDA device.
    """

    def __init__(self, capacity: int, pin: bool) -> None:
        super().__init__(capacity)
        self.pin = pin

    def tensor(self, dtype: np.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A fresh host tensor of this sink's kind (pinned or not), which will belong to the consumer."""
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), pin_memory=self.pin)

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.tensor(dtype, shape).numpy()

    def owned(self, arrays: Sequence[np.ndarray], owned: bool) -> list[Any]:
        """Tensors sharing the memory of arrays from ``empty``; views of libzmq's frames copied into ours."""
        return [tensor_of(array) if owned else self._copy(array) for array in arrays]

    def _copy(self, array: np.ndarray) -> torch.Tensor:
        """One copy of a view of libzmq's frames (read-only, freed with the message) into a tensor of ours."""
        tensor = self.tensor(array.dtype, array.shape)
        np.copyto(tensor.numpy(), array)
        return tensor
