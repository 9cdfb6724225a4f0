#!/usr/bin/env python3
"""What the trainer takes in: ZMQInput against a bare pyzmq receive loop, same producers, one run.

Producers serve pre-made batches (``--repeat-batches``: 64 x 224 x 224 x 3 uint8 plus labels,
index, epoch; decoding out of the way) on loopback. This process receives them:

- bare: a PULL socket connected to every producer, ``recv_multipart(copy=False)`` and
  ``stoker.protocol.decode_batch`` (zero-copy views), nothing else: the ceiling;
- bare + copy: the same, plus one copy of each array into an aligned buffer (what any
  TensorFlow input must do with a libzmq frame, see docs/decisions.md): the one-copy ceiling;
- ZMQInput: the real input, feeding a trivial ``tf.function`` step that takes each batch
  from ``get()`` (dequeue, StagingArea) without computing on it;
- ZMQInput as before ``TensorImporter``: the same, with arrays enqueued through
  ``tf.convert_to_tensor`` (the baseline the importer replaced, kept here to measure it);
- ZMQInput with default arguments (``receive="auto"``: direct receive on tcp://), each producer's
  stream read over ZMTP straight into aligned memory TensorFlow then owns (no copy beyond the
  kernel's), the same step. The "ZMQInput (libzmq)" column asks for ``receive="libzmq"``;
- TorchInput with default arguments (direct receive into torch tensors, CPU device), a loop that
  takes each batch (``--no-torch`` leaves it out; skipped where torch is not installed). Where TensorFlow is not
  installed the ZMQInput receivers are left out (a PyTorch-only GPU host) and the output says so.

For each: images/s, GB/s, and this process's CPU-seconds per GB taken in (user + system),
with 1 and 4 producers, interleaved rounds, the median kept (this VM is shared: single rounds
swing by 20%). Targets: ZMQInput and TorchInput with default arguments >= 0.95 of bare in images/s,
and at most 1.3x bare's CPU-seconds per GB (``direct ratio``, ``direct CPU``; ``torch ratio``, ``torch CPU``). ``--trainer-cpus`` and
``--producer-cpus`` pin the two sides to separate cores (a many-core host, as in gpu_suite.py). On a small host
compare receive paths pinned: unpinned, where the scheduler puts the two sides sets a round's speed (bimodal on a
2-core VM, docs/performance.md section 21), not the code.
Prints a table and writes JSON (default benchmarks/results/trainer_ingest.json).
Run:  python benchmarks/trainer_ingest.py [--batches 500] [--rounds 5] [--producers 1,4]
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from contextlib import ExitStack
from pathlib import Path

from delivery import bare_receive, torch_input_receive, zmq_input_receive
from harness import (add_out_argument, benchmark_parser, launch_sharded, machine_info, producer_flags,
                     synthetic_lmdb, write_results)

#: what each receiver measured in one round: (images/s, bytes/s, CPU s per GB)
Measured = tuple[float, float, float]


def _pin_process(pid: int, cores: set[int]) -> None:
    """Pin every thread of ``pid`` (sched_setaffinity on a pid moves only that one thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile


def _cpu_list(text: str) -> set[int]:
    """Cores from ``0-3,8``-style text (empty: none)."""
    cores: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=100, help="batches before timing: past the queue filling up and its buffers being allocated")
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median of each is kept")
    parser.add_argument("--producers", default="1,4", help="comma-separated producer counts")
    parser.add_argument("--trainer-cpus", default="", metavar="LIST",
                        help="pin this process (the trainer) to these cores, e.g. 0-3 (default: no pinning)")
    parser.add_argument("--producer-cpus", default="", metavar="LIST",
                        help="pin the producers and their workers to these cores, e.g. 4-15: on a many-core host "
                             "the producers' cores are then not the trainer's")
    parser.add_argument("--no-torch", action="store_true", help="leave TorchInput out")
    add_out_argument(parser, "trainer_ingest.json")
    return parser.parse_args()


def measure_rounds(endpoints: list[str], args) -> dict[str, list[Measured]]:
    """Every receiver once per round, in the same order each round."""
    b, s, warmup, batches = args.batch_size, args.image_size, args.warmup, args.batches
    results: dict[str, list[Measured]] = {"bare": [], "bare_copy": [], **(
        {"zmq_convert": [], "zmq_input": [], "zmq_direct": []} if args.tf else {})}
    for _ in range(args.rounds):
        results["bare"].append(bare_receive(endpoints, warmup, batches))
        results["bare_copy"].append(bare_receive(endpoints, warmup, batches, copy=True))
        if args.tf:
            results["zmq_convert"].append(zmq_input_receive(endpoints, b, s, warmup, batches, convert=True))
            results["zmq_input"].append(zmq_input_receive(endpoints, b, s, warmup, batches))
            results["zmq_direct"].append(zmq_input_receive(endpoints, b, s, warmup, batches, receive=None))
        if args.torch:
            results.setdefault("torch", []).append(torch_input_receive(endpoints, b, s, warmup, batches))
    return results


def table_row(count: int, results: dict[str, list[Measured]]) -> dict:
    """One producer count's row: the medians over rounds of each receiver, and their ratios."""
    best = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in results.items()}
    return {"producers": count, "bare_images_per_s": best["bare"][0], "bare_gb_per_s": best["bare"][1] / 1e9,
            "bare_cpu_s_per_gb": best["bare"][2], "bare_copy_images_per_s": best["bare_copy"][0],
            "bare_copy_cpu_s_per_gb": best["bare_copy"][2], **(_tf_columns(best) if "zmq_input" in best else {}),
            **({"torch_images_per_s": best["torch"][0], "torch_cpu_s_per_gb": best["torch"][2],
                "torch_ratio": best["torch"][0] / best["bare"][0],
                "torch_cpu_ratio": best["torch"][2] / best["bare"][2]} if "torch" in best else {}),
            "rounds": {k: [list(r) for r in v] for k, v in results.items()}}


def _tf_columns(best: dict[str, tuple[float, ...]]) -> dict[str, float]:
    """The ZMQInput receivers' medians and ratios (where TensorFlow is installed)."""
    return {"convert_images_per_s": best["zmq_convert"][0], "convert_cpu_s_per_gb": best["zmq_convert"][2],
            "zmq_images_per_s": best["zmq_input"][0],
            "zmq_gb_per_s": best["zmq_input"][1] / 1e9, "zmq_cpu_s_per_gb": best["zmq_input"][2],
            "ratio": best["zmq_input"][0] / best["bare"][0],
            "copy_ratio": best["bare_copy"][0] / best["bare"][0],
            "convert_ratio": best["zmq_convert"][0] / best["bare"][0],
            "ratio_to_one_copy": best["zmq_input"][0] / best["bare_copy"][0],
            "direct_images_per_s": best["zmq_direct"][0], "direct_gb_per_s": best["zmq_direct"][1] / 1e9,
            "direct_cpu_s_per_gb": best["zmq_direct"][2],
            "direct_ratio": best["zmq_direct"][0] / best["bare"][0],
            "direct_cpu_ratio": best["zmq_direct"][2] / best["bare"][2]}


def print_table(rows: list[dict], args) -> None:
    print(f"trainer ingest, {args.batch_size} x {args.image_size} px batches from --repeat-batches producers on "
          f"loopback, median of {args.rounds} interleaved rounds")
    if args.tf:
        print_tf_table(rows)
    else:
        print("ZMQInput: not measured (TensorFlow is not installed)")
    print_torch_table(rows)


def print_tf_table(rows: list[dict]) -> None:
    print(f"{'producers':>9} | {'bare img/s':>10} | {'GB/s':>5} | {'CPU s/GB':>8} | {'+copy img/s':>11} | "
          f"{'CPU s/GB':>8} | {'before img/s':>12} | {'CPU s/GB':>8} | {'ZMQInput img/s':>14} | {'GB/s':>5} | {'CPU s/GB':>8} | {'ratio':>5} | {'copy':>5} | "
          f"{'vs copy':>7} | {'direct img/s':>12} | {'CPU s/GB':>8} | {'direct ratio':>12} | {'direct CPU':>10}")
    print("-" * 207)
    for r in rows:
        print(f"{r['producers']:>9} | {r['bare_images_per_s']:>10.0f} | {r['bare_gb_per_s']:>5.2f} | "
              f"{r['bare_cpu_s_per_gb']:>8.3f} | {r['bare_copy_images_per_s']:>11.0f} | {r['bare_copy_cpu_s_per_gb']:>8.3f} | "
              f"{r['convert_images_per_s']:>12.0f} | {r['convert_cpu_s_per_gb']:>8.3f} | "
              f"{r['zmq_images_per_s']:>14.0f} | {r['zmq_gb_per_s']:>5.2f} | {r['zmq_cpu_s_per_gb']:>8.3f} | "
              f"{r['ratio']:>5.3f} | {r['copy_ratio']:>5.3f} | {r['ratio_to_one_copy']:>7.3f} | "
              f"{r['direct_images_per_s']:>12.0f} | {r['direct_cpu_s_per_gb']:>8.3f} | {r['direct_ratio']:>12.3f} | "
              f"{r['direct_cpu_ratio']:>10.2f}")
    print("before: ZMQInput with tf.convert_to_tensor (before TensorImporter); ratio: ZMQInput / bare; "
          "copy: (bare + one copy) / bare; vs copy: ZMQInput / (bare + one copy); direct: ZMQInput() with default arguments (direct receive), "
          "direct ratio: it / bare; direct CPU: its CPU s/GB / bare's")


def print_torch_table(rows: list[dict]) -> None:
    if any("torch_ratio" in r for r in rows):
        print(f"\n{'producers':>9} | {'bare img/s':>10} | {'TorchInput img/s':>16} | {'CPU s/GB':>8} | "
              f"{'torch ratio':>11} | {'torch CPU':>9}")
        for r in rows:
            print(f"{r['producers']:>9} | {r['bare_images_per_s']:>10.0f} | {r['torch_images_per_s']:>16.0f} | "
                  f"{r['torch_cpu_s_per_gb']:>8.3f} | {r['torch_ratio']:>11.3f} | {r['torch_cpu_ratio']:>9.2f}")
        print("TorchInput() with default arguments (direct receive into tensors, CPU device); torch ratio: it / bare; "
              "torch CPU: its CPU s/GB / bare's")


def main() -> None:
    args = parse_args()
    args.torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    args.tf = importlib.util.find_spec("tensorflow") is not None  # ZMQInput's receivers need it; bare and torch do not
    if not args.tf and not args.torch:
        raise SystemExit("trainer_ingest.py: neither TensorFlow nor PyTorch is installed: no trainer input to measure")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    trainer_cpus, producer_cpus = _cpu_list(args.trainer_cpus), _cpu_list(args.producer_cpus)
    if trainer_cpus:
        _pin_process(os.getpid(), trainer_cpus)  # before TensorFlow starts its thread pools
    rows = []
    with synthetic_lmdb(64) as path:
        for count in (int(c) for c in args.producers.split(",")):
            flags = producer_flags(args.batch_size, args.image_size, repeat_batches=True, seed=0)
            with ExitStack() as stack:
                producers = launch_sharded(stack, path, count, flags)
                if producer_cpus:
                    for p in producers:
                        for pid in (p.pid, *p.child_pids()):
                            _pin_process(pid, producer_cpus)
                results = measure_rounds([p.endpoint for p in producers], args)
            rows.append(table_row(count, results))
    print_table(rows, args)
    result = {"benchmark": "trainer_ingest", "rows": rows, "batch_size": args.batch_size, "image_size": args.image_size,
              "batches_timed": args.batches, "target_ratio": 0.95, "target_cpu_ratio": 1.3, **machine_info(),
              "trainer_cpus": sorted(trainer_cpus), "producer_cpus": sorted(producer_cpus)}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
