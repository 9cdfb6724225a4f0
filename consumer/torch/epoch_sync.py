"""The ranks of a ``torch.distributed`` job agreeing on epochs: ``EpochSync`` over the process group.

``TorchInput.epochs()`` uses it under ``torch.distributed`` (the share taken from the process group): one
all-reduce of one integer per step (whether any rank still has records of the epoch, as DDP's ``Join`` does)
and one at each epoch's end (the job's consumed epochs). Collective: every rank calls each in the same order,
which ``epoch_loop.EpochLoop`` guarantees; a wait lasts as long as the process group's timeout allows, like
any collective (``init_process_group(timeout=...)``). Tensors live where the backend wants them
(``job_state._device``: CUDA for NCCL, the CPU for gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stoker.consumer.torch.job_state import _device


class ProcessGroupSync:
    """``EpochSync`` over the default process group; ``device``: this rank's input device (its GPU under NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = _device(device)

    def _reduce(self, value: int, op: dist.ReduceOp) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return int(tensor.item())

    def any(self, flag: bool) -> bool:
        return self._reduce(int(flag), dist.ReduceOp.MAX) > 0

    def min(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MIN)
