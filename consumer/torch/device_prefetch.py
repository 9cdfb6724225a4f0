"""DevicePrefetch: host batches onto the training device, ``prefetch`` batches ahead, the copies hidden.

    PinnedSink (pinned host tensors) --stage()--> side CUDA stream: copy, channels_last, dtype --pop()--> the step

What StagingArea does for TensorFlow, written as NVIDIA Apex's ``data_prefetcher`` and DALI's PyTorch
plugin do it. On a CUDA device ``stage(host)`` enqueues the batch's copies (``non_blocking=True``, from
pinned memory: DMA, asynchronous to the host) and the conversions on a side ``torch.cuda.Stream``, then
records an event there; it returns at once. ``pop()`` hands out the oldest staged batch after making the
*current* stream (the one the step's kernels go to) wait on that event (``wait_event``: a GPU-side wait,
the host does not block), and calls ``record_stream`` on each device tensor, so the caching allocator does
not reuse its memory, allocated on the side stream, while the step's stream may still use it.

The host batch must outlive its copy: a ``non_blocking`` copy reads the pinned memory after ``stage``
returned. Each host batch is kept, with its event, until the event completed (checked at every ``pop``;
more than ``prefetch`` batches waiting there are waited for, so host memory stays bounded), and ``close()``
synchronizes the side stream before letting them go.

On the CPU (``device="cpu"``) the same functions run with no stream and no event: ``to(cpu)`` returns the
host tensor itself, so a batch is the sink's tensors (the caller's to keep), after the same optional
conversions. Conversions (``convert``), both devices alike:

- ``channels_last``: each 4-D array, sent NHWC as producers send images, becomes the NCHW tensor
  ``permute(0, 3, 1, 2)``, which is in ``torch.channels_last`` memory format as it stands: no copy.
- ``dtypes``: ``{name: torch.dtype}``, converted on the device after the copy, so ``uint8`` images cross the
  bus at a quarter of ``float32``'s bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

Batch = dict[str, torch.Tensor]


def convert(host: Batch, device: torch.device, channels_last: bool, dtypes: Mapping[str, torch.dtype],
            non_blocking: bool) -> Batch:
    """``host`` on ``device`` with the conversions of the module doc (on the current stream)."""
    out = {}
    for name, tensor in host.items():
        tensor = tensor.to(device, non_blocking=non_blocking)  # the same tensor when it is already there
        if channels_last and tensor.dim() == 4:
            tensor = tensor.permute(0, 3, 1, 2)  # NHWC bytes as NCHW in channels_last memory format: a view
        if name in dtypes:
            tensor = tensor.to(dtypes[name])  # keeps the memory format
        out[name] = tensor
    return out


@dataclass
class Staged:
    """A batch on its way: the device tensors, the host batch they are copied from, the copy's event
    (None on the CPU) and what the facade attached (``note``: exact mode's rows to report consumed)."""

    tensors: Batch
    host: Optional[Batch]
    ready: Optional[Any]  # torch.cuda.Event
    note: Any


class DevicePrefetch:
    """Stages host batches on ``device`` (``"cpu"`` or ``"cuda:N"``), at most ``prefetch`` ahead; see the module doc.

    One consumer thread calls ``stage``, ``pop`` and ``close``.
    """

    def __init__(self, device: torch.device, prefetch: int, channels_last: bool = False,
                 dtypes: Optional[Mapping[str, torch.dtype]] = None) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch}: give batches >= 1 (default 2)")
        self.device = device
        self.prefetch = prefetch
        self.channels_last = channels_last
        self.dtypes = dict(dtypes or {})
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staged: deque[Staged] = deque()
        self._landing: deque[Staged] = deque()  # handed out, copy perhaps still running: the host batch kept

    def __len__(self) -> int:
        """Batches staged and not yet handed out."""
        return len(self._staged)

    def full(self) -> bool:
        return len(self._staged) >= self.prefetch

    def stage(self, host: Batch, note: Any = None) -> None:
        """Start moving ``host`` to the device (CUDA: enqueued on the side stream, returns at once)."""
        if self._stream is None:
            self._staged.append(Staged(convert(host, self.device, self.channels_last, self.dtypes, False), None,
                                       None, note))
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            tensors = convert(host, self.device, self.channels_last, self.dtypes, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._staged.append(Staged(tensors, host, ready, note))

    def pop(self) -> tuple[Batch, Any]:
        """The oldest staged batch and its note, ready for the work queued from now on on the current stream."""
        staged = self._staged.popleft()
        if staged.ready is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(staged.ready)
            for tensor in staged.tensors.values():
                tensor.record_stream(consumer)
            self._landing.append(Staged({}, staged.host, staged.ready, None))
            self._release()
        return staged.tensors, staged.note

    def _release(self) -> None:
        """Let go of the host batches whose copies completed; wait for the oldest past ``prefetch`` of them."""
        while self._landing:
            oldest = self._landing[0]
            if len(self._landing) > self.prefetch:
                oldest.ready.synchronize()
            elif not oldest.ready.query():
                return
            self._landing.popleft()

    def close(self) -> None:
        """Drop what is staged, once every copy that reads a host batch has completed (bounded by those copies)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._staged.clear()
        self._landing.clear()
