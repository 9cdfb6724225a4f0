"""The GPU suite's PyTorch sections (run by gpu_suite.py, each in its own process, like the TensorFlow ones).

- ``torch_correctness``: two producers serve the checksum dataset (checksum_pipeline.py); ``TorchInput`` with
  ``device=`` the GPU (host tensors pinned, copies on its side stream) hands out batches whose checksums are
  taken *on that device* and compared with the dataset's bytes by each row's record index. Reports samples,
  mismatches, the device the tensors live on, and whether the host side was pinned.
- ``torch_latency``: a training step of torchvision's ResNet-50 (channels_last, SGD; float32 or bf16 autocast)
  fed by a constant batch already on the device vs by ``TorchInput`` (``channels_last=True``, ``dtypes`` float32
  on the device) from two ``--repeat-batches`` producers: median step times over interleaved rounds, the ratio
  (goal <= 1.02) and queue occupancy. Then a ``torch.profiler`` trace of a few TorchInput-fed steps: the share
  of host-to-device copy time (``Memcpy HtoD`` on the GPU) that runs while a kernel runs on another stream. A
  share near 1 means the side stream hides the copy behind the step.

Dry mode (no GPU): the CPU device and a small CNN (torchvision may be absent); the trace is the host's, whose
copies are the dtype conversions (``aten::_to_copy``): the parser runs on a real trace, the figure means nothing.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from harness import launch_sharded, producer_flags

HERE = Path(__file__).resolve().parent


def torch_device(p: dict[str, Any]) -> str:
    return "cuda:0" if p["device"] == "GPU" else "cpu"


def section_torch_correctness(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    from checksum_pipeline import build_checksum_lmdb, checksum_weights
    from stoker.consumer import TorchInput

    device, size = torch_device(p), p["check_size"]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        expected = build_checksum_lmdb(Path(tmp) / "checks", p["check_records"], size)
        flags = ["--pipeline", f"{HERE / 'checksum_pipeline.py'}:make_pipeline", "--pipeline-arg", f"size={size}",
                 *producer_flags(p["check_batch"])]
        addresses = [q.endpoint for q in launch_sharded(stack, Path(tmp) / "checks", 2, flags)]
        weights = torch.from_numpy(checksum_weights(size)).to(device)
        samples = mismatches = 0
        devices: set[str] = set()
        with TorchInput(addresses, device=device, recv_timeout=60) as inp:
            pinned = inp.pinned  # pinned where CUDA is available
            for _, batch in zip(range(p["check_batches"]), inp):
                sums = (batch["images"].to(torch.int64) * weights).sum(dim=(1, 2, 3))  # on the device
                devices.add(str(batch["images"].device))
                for index, total in zip(batch["index"].tolist(), sums.tolist()):
                    mismatches += int(expected[int(index)] != int(total))
                samples += len(sums)
    return {"device": device, "samples": samples, "mismatches": mismatches, "tensor_devices": sorted(devices),
            "pinned": bool(pinned), "ok": mismatches == 0 and samples > 0 and devices == {str(torch.device(device))}}


def build_torch_model(name: str, classes: int):
    import torch.nn as nn

    if name == "small-cnn":
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=classes)


def train_step(model, device, precision: str) -> Callable:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train(images, labels) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(images / 127.5 - 1), labels.long())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return train


def _step_seconds(step: Callable[[], Any], steps: int, warmup: int, sync: Callable[[], None]) -> float:
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def copy_overlap(events: list, on_gpu: bool) -> dict[str, Any]:
    """Share of copy time during which a compute op ran on another stream (GPU) or thread (dry mode's host)."""
    def is_copy(e) -> bool:
        return e.name().startswith("Memcpy HtoD") if on_gpu else e.name() == "aten::_to_copy"

    kind = "CUDA" if on_gpu else "CPU"
    mine = [e for e in events if str(e.device_type()).endswith(kind)]
    copies = [e for e in mine if is_copy(e)]
    compute = [e for e in mine if not is_copy(e) and not e.name().startswith(("Memcpy", "Memset"))]
    copy_ns = overlapped_ns = 0
    for c in copies:
        start, end = c.start_ns(), c.start_ns() + c.duration_ns()
        spans = sorted((max(start, k.start_ns()), min(end, k.start_ns() + k.duration_ns())) for k in compute
                       if k.device_resource_id() != c.device_resource_id())
        covered, reach = 0, start
        for lo, hi in spans:
            if hi > max(lo, reach):
                covered += hi - max(lo, reach)
                reach = hi
        copy_ns += end - start
        overlapped_ns += covered
    return {"where": "gpu" if on_gpu else "host", "copy_events": len(copies),
            "overlapped_share": overlapped_ns / copy_ns if copy_ns else None}


def section_torch_latency(p: dict[str, Any], precision: str = "float32") -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stoker.consumer import TorchInput
    from stoker.producer.dataset.build.synthetic import build_synthetic

    device, size, batch, classes = torch.device(torch_device(p)), p["image_size"], p["batch_size"], 1000
    model = build_torch_model(p["model"], classes)
    train = train_step(model.to(device, memory_format=torch.channels_last), device, precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    const_images = torch.randint(0, 255, (batch, 3, size, size), device=device).float().contiguous(
        memory_format=torch.channels_last)
    const_labels = torch.arange(batch, device=device) % classes
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        build_synthetic(Path(tmp) / "synth", 64, seed=0, progress=False)
        addresses = [q.endpoint for q in launch_sharded(stack, Path(tmp) / "synth", 2,
                                                         producer_flags(batch, size, repeat_batches=True))]
        inp = stack.enter_context(TorchInput(addresses, device=device, channels_last=True,
                                             dtypes={"images": torch.float32}, recv_timeout=120))
        batches = iter(inp)

        def fed_step():
            b = next(batches)
            return train(b["images"], b["labels"])

        constant_s, fed_s = [], []
        for _ in range(p["rounds"]):
            constant_s.append(_step_seconds(lambda: train(const_images, const_labels), p["steps"], p["warmup"], sync))
            fed_s.append(_step_seconds(fed_step, p["steps"], p["warmup"], sync))
        occupancy = inp.stats.mean_queue_occupancy
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(p["profile_steps"]):
                fed_step()
            sync()
        overlap = copy_overlap(list(prof.profiler.kineto_results.events()), device.type == "cuda")
    const, fed = statistics.median(constant_s), statistics.median(fed_s)
    out = {"model": p["model"] if p["model"] != "resnet50" else "torchvision resnet50", "precision": precision,
           "device": str(device), "batch_size": batch, "image_size": size, "constant_ms": 1000 * const,
           "torch_ms": 1000 * fed, "ratio": fed / const, "goal": 1.02, "goal_met": fed / const <= 1.02,
           "images_per_s": batch / fed, "queue_occupancy": occupancy, "overlap": overlap,
           "rounds": {"constant_s": constant_s, "torch_s": fed_s}, "ok": overlap["copy_events"] > 0}
    if not out["ok"]:
        out["error"] = "the profiler trace holds no host-to-device copy: the overlap is not measured"
    return out


def markdown_rows(sections: dict[str, Any]) -> list[str]:
    """The PyTorch sections' lines of the suite's Markdown report."""
    lines: list[str] = []
    c = sections.get("torch_correctness", {})
    if "samples" in c:
        lines += ["| PyTorch correctness | samples checked | mismatches | tensors on | host memory |",
                  "|---|---|---|---|---|",
                  f"| TorchInput | {c['samples']} | {c['mismatches']} | {', '.join(c['tensor_devices'])} | "
                  f"{'pinned' if c['pinned'] else 'pageable'} |", ""]
    latency = [sections[k] for k in ("torch_latency", "torch_latency_bf16") if "ratio" in sections.get(k, {})]
    if latency:
        lines += ["| PyTorch model | precision | batch | constant ms | TorchInput ms | ratio (goal <= 1.02) | queue | "
                  "copy overlapped |", "|---|---|---|---|---|---|---|---|"]
    for r in latency:
        share = r["overlap"]["overlapped_share"]
        lines += [f"| {r['model']} | {r['precision']} | {r['batch_size']} | {r['constant_ms']:.1f} | {r['torch_ms']:.1f} | "
                  f"{r['ratio']:.3f}{'' if r['goal_met'] else ' *'} | {r['queue_occupancy']:.2f} | "
                  f"{'n/a' if share is None else f'{share:.2f}'} ({r['overlap']['where']}, "
                  f"{r['overlap']['copy_events']} copies) |"]
    return lines + ([""] if latency else [])
