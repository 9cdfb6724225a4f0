"""The job state of a ``torch.distributed`` job: every rank's input state gathered and merged, without pickle.

``gather_bytes`` all-gathers one ``bytes`` value per rank as uint8 tensors (lengths first, then the padded bytes),
on the process group's own device (CUDA for NCCL, the CPU for gloo): ``all_gather_object`` would pickle them.
``job_state_of`` merges what was gathered (``merge_states``), so every rank ends up with the same bytes, which
any rank of a later job of any size continues from. Collective: every rank calls it, as every rank calls
``dcp.save``; it waits as long as the process group's timeout allows, like any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stoker.consumer.exact.state import merge_states


def _device(device: torch.device) -> torch.device:
    """Where the collective's tensors go: NCCL takes only CUDA tensors, on this rank's own GPU (the input's device
    where it is one; else the current device, which ``torch.cuda.set_device`` must have set)."""
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def gather_bytes(data: bytes, device: torch.device = torch.device("cpu")) -> list[bytes]:
    """Every rank's ``data``, by rank (collective; ``device``: this rank's GPU under NCCL)."""
    device, world = _device(device), dist.get_world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [bytes(g[:int(n.item())].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths)]


def job_state_of(state: bytes, device: torch.device = torch.device("cpu")) -> bytes:
    """The job state merged from every rank's ``save_state()`` bytes (collective; ValueError from the merge)."""
    return merge_states(gather_bytes(state, device))
