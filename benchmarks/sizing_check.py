#!/usr/bin/env python3
"""Is the trainer's answer to "how many producers?" right within one? A real step, real producers, real decoding.

1. The step's true demand: a training step (torchvision ResNet-50 on a GPU; a small CNN on CPU with ``--dry``) on a
   constant batch already on the device: ``batch / step time``.
2. Under-provisioned: ``--producers`` producers (``--workers`` decode workers each, the imagenet pipeline on a
   synthetic LMDB) feed ``TorchInput``; after ``--seconds`` of training, ``inp.sizing`` gives the estimate: demand,
   one producer's capacity, the fractional need, the answer D.
3. The answer checked: D, D - 1 and D - 2 producers (where >= 1). With D the step should not wait for input; with
   D - 2 it should (else D is more than one too many). Each phase reports the images/s taken (the mean over its
   second half, waits included), the share of time waited, the fed / constant step time, and its own estimate.

Prints a table and writes JSON (default benchmarks/results/sizing_check.json). Needs PyTorch (and torchvision for
ResNet-50). Run:  python benchmarks/sizing_check.py [--precision bf16] [--producers 3] [--workers 1] [--seconds 30]
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from typing import Any

from gpu_torch import build_torch_model, train_step
from harness import add_out_argument, benchmark_parser, launch_sharded, producer_flags, synthetic_lmdb, write_results


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--dry", action="store_true", help="CPU, a small CNN at 32 px, short phases (checks the script)")
    parser.add_argument("--precision", choices=("float32", "bf16"), default="bf16")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--producers", type=int, default=3, help="the under-provisioned pool the estimate is read in")
    parser.add_argument("--workers", type=int, default=1, help="decode workers per producer")
    parser.add_argument("--seconds", type=float, default=30.0, help="training seconds per phase")
    parser.add_argument("--records", type=int, default=512)
    add_out_argument(parser, "sizing_check.json")
    return parser.parse_args()


def phase(path, count: int, args, train, device, size: int) -> dict[str, Any]:
    """``count`` producers feed the step for ``args.seconds``; the step times of the second half and the estimate."""
    import torch

    from stoker.consumer import TorchInput

    with ExitStack() as stack:
        producers = launch_sharded(stack, path, count, producer_flags(args.batch_size, size, workers=args.workers),
                                   parallel=True)
        inp = stack.enter_context(TorchInput([p.endpoint for p in producers], device=device, channels_last=True,
                                             dtypes={"images": torch.float32}, recv_timeout=120))
        batches = iter(inp)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        started, times = time.monotonic(), []
        # --dry (a test): on past the phase until the estimate is read, bounded, so a slow host still checks it
        limit = 6 * args.seconds if args.dry else args.seconds
        while time.monotonic() - started < args.seconds or (
                inp.sizing.producers_needed is None and time.monotonic() - started < limit):
            t0 = time.perf_counter()
            b = next(batches)
            train(b["images"], b["labels"])
            sync()
            times.append(time.perf_counter() - t0)
        sizing = inp.sizing
    late = times[len(times) // 2:]
    d, s = sizing.demand, sizing.supply
    # The mean over the second half, waits included: a median would hide an input-bound run's long steps.
    return {"producers": count, "steps": len(times), "fed_step_s": statistics.fmean(late),
            "fed_images_per_s": args.batch_size * len(late) / sum(late),
            "wait_fraction": d.wait_fraction if d else None, "demand_images_per_s": d.images_per_s if d else None,
            "capacity_per_producer": s.per_producer_images_per_s if s else None,
            "producers_needed": sizing.producers_needed, "desired": sizing.desired_producers, "why": sizing.why}


def main() -> None:
    args = parse_args()
    import torch

    device = torch.device("cuda:0" if torch.cuda.is_available() and not args.dry else "cpu")
    size, model_name = (32, "small-cnn") if args.dry else (224, "resnet50")
    if args.dry:
        args.batch_size, args.seconds, args.records = 16, min(args.seconds, 6.0), 64
    model = build_torch_model(model_name, 1000)
    train = train_step(model.to(device, memory_format=torch.channels_last), device, args.precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    images = torch.randint(0, 255, (args.batch_size, 3, size, size), device=device).float().contiguous(
        memory_format=torch.channels_last)
    labels = torch.arange(args.batch_size, device=device) % 1000
    for _ in range(5):
        train(images, labels)
    sync()
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < (2.0 if args.dry else 10.0):
        train(images, labels)
        steps += 1
    sync()
    constant_s = (time.perf_counter() - t0) / steps
    true_demand = args.batch_size / constant_s
    phases = []
    with synthetic_lmdb(args.records) as path:
        first = phase(path, args.producers, args, train, device, size)
        phases.append(first)
        answer = first["desired"]
        if answer is not None:
            for count in dict.fromkeys([answer, answer - 1, answer - 2]):
                if count >= 1 and count != args.producers:
                    phases.append(phase(path, count, args, train, device, size))
                    print(f"{count} producers: {phases[-1]['fed_images_per_s']:,.0f} images/s", flush=True)
    for p in phases:
        p["fed_over_constant"] = p["fed_step_s"] / constant_s
    print(f"sizing check: {model_name} {args.precision} batch {args.batch_size} on {device}; constant-batch step "
          f"{1000 * constant_s:.1f} ms = {true_demand:,.0f} images/s (the true demand)")
    print(f"{'producers':>9} | {'images/s':>8} | {'fed/const':>9} | {'waited':>6} | {'est. demand':>11} | {'per producer':>12} | "
          f"{'needed':>6} | {'answer':>6}")
    for p in phases:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{p['producers']:>9} | {p['fed_images_per_s']:>8,.0f} | {p['fed_over_constant']:>9.3f} | {fmt(p['wait_fraction'], '.0%'):>6} | "
              f"{fmt(p['demand_images_per_s'], ',.0f'):>11} | {fmt(p['capacity_per_producer'], ',.0f'):>12} | "
              f"{fmt(p['producers_needed'], '.2f'):>6} | {fmt(p['desired'], 'd'):>6}")
    print(f"estimate read with {args.producers} producers: {first['why']}")
    write_results(args.out, {"benchmark": "sizing_check", "model": model_name, "precision": args.precision,
                             "device": str(device), "batch_size": args.batch_size, "workers": args.workers,
                             "constant_step_s": constant_s, "true_demand_images_per_s": true_demand,
                             "phases": phases})


if __name__ == "__main__":
    main()
