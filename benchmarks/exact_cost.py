#!/usr/bin/env python3
"""What exact epochs cost: the same job with the control channel off (plain) and on (--exact), one run.

A producer (2 workers, random-resized-crop 224 px, batches of 64) feeds a trainer on the same
machine whose ``tf.function`` step only takes the batch (``get()``): the end-to-end rate is then
the input's, and every cost of exact mode shows (credit and consumed-record messages, the
producer choosing each batch's records, the trainer reporting each step's records through a
``tf.numpy_function`` and cutting padding off). Interleaved rounds (the order of the modes rotates
from round to round); each ratio is the median of the per-round ratios, so a slow drift of the
shared machine cancels within a round instead of landing on one mode.
Target: exact / plain >= 0.97 with fixed shards and with an elastic pool (``--shard auto``: the
trainer hands out splits and drops rows that arrived before), both modes on ZMQInput's default
receive path (direct receive: our ZMTP reads each batch into memory TensorFlow owns). Exact mode
over libzmq (``receive="libzmq"``, what CurveZMQ jobs run) is measured too: the copy a libzmq
frame costs. Also prints where the CPU goes (ms per batch of
the producer daemon, its workers and the trainer process, from /proc) and the input state per
million records.

Prints a table and writes JSON (default benchmarks/results/exact_cost.json).
Run:  python benchmarks/exact_cost.py [--batches 150] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from harness import (add_out_argument, benchmark_parser, cpu_now, launch_producer, machine_info, producer_flags,
                     synthetic_lmdb, write_results)


def rate(lmdb_path: Path, exact: bool, batch: int, size: int, workers: int, warmup: int, batches: int,
         receive: str | None = None, pool: bool = False) -> tuple[float, dict[str, float]]:
    """Images/s end to end, and CPU ms per batch of the producer daemon, its workers and this trainer process;
    ``receive``: ZMQInput's ``receive=`` (None: its default); ``pool``: the producer is an elastic pool's
    (``--shard auto``: the trainer hands out splits, exact mode)."""
    import tensorflow as tf

    from stoker.consumer import ZMQInput

    flags = producer_flags(batch, size, workers, seed=0, exact=exact, shard="auto" if pool else None)
    with launch_producer(lmdb_path, flags) as producer:
        shape = dict(batch_size=batch, image_shape=(size, size, 3))
        choice = {} if receive is None else {"receive": receive}
        with ZMQInput([producer.endpoint], exact=exact, recv_timeout=120, **shape, **choice) as inp:
            @tf.function
            def step():
                return tf.shape(inp.get()["images"])[0]

            for _ in range(warmup):
                int(step())
            workers_pids = producer.child_pids()  # read once: the /proc scan stays out of the timed window
            before, t0, images = cpu_now([producer.pid], workers_pids), time.perf_counter(), 0
            for _ in range(batches):
                images += int(step())
            elapsed, used = time.perf_counter() - t0, cpu_now([producer.pid], workers_pids) - before
            per_batch = {name: seconds * 1000 / batches
                         for name, seconds in (("daemon", used.daemons), ("workers", used.workers), ("trainer", used.own))}
            return images / elapsed, per_batch


def state_sizes() -> dict[str, int]:
    """Bytes of the input state of one million-record shard at the start, middle and end of an epoch."""
    from stoker.protocol.input_state import InputState

    key, order = "0/1:1000000:0", np.random.default_rng(0).permutation(1_000_000)
    sizes = {}
    for label, fraction in (("start", 0.0), ("middle", 0.5), ("end", 1.0)):
        state = InputState()
        state.progress(key)
        state.mark(key, [0] * int(fraction * len(order)), order[: int(fraction * len(order))])
        state.progress(key).close_complete()
        sizes[label] = len(state.to_bytes())
    return sizes


MODES = ("plain", "exact", "exact_pool", "exact_libzmq")
#: the exact modes' rows: mode, label, what it is
EXACT_ROWS = (("exact", "exact", "exact mode, fixed shard"),
              ("exact_pool", "pool", "exact, an elastic pool: --shard auto, the trainer hands out splits"),
              ("exact_libzmq", "libzmq", "exact, fixed shard, receive='libzmq' (as with CurveZMQ)"))


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds; the median of each is kept")
    add_out_argument(parser, "exact_cost.json")
    return parser.parse_args()


def run_rounds(args) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Images/s and CPU ms per batch of every mode, per round; the order of the modes rotates from round to round."""
    rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    modes = list(MODES)
    with synthetic_lmdb(args.records) as path:
        for r in range(args.rounds):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                images_per_s, per_batch = rate(path, mode.startswith("exact"), args.batch_size, args.image_size,
                                               args.workers, args.warmup, args.batches,
                                               "libzmq" if mode == "exact_libzmq" else None, pool=mode == "exact_pool")
                rounds[mode].append(images_per_s)
                cpu[mode].append(per_batch)
    return rounds, cpu


def print_table(args, rounds: dict[str, list[float]], ratio: dict[str, float],
                quartiles: dict[str, tuple[float, float]], cpu_medians: dict[str, dict[str, float]],
                sizes: dict[str, int]) -> None:
    print(f"end to end, {args.workers} workers, {args.image_size} px, batches of {args.batch_size}, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'mode':>6} | {'images/s':>9} | {'x plain':>8} | {'quartiles':>13}")
    print("-" * 46)
    print(f"{'plain':>6} | {statistics.median(rounds['plain']):>9.0f} | {1.0:>8.3f} | {'':>13}   "
          "(ZMQInput's default receive path)")
    for mode, label, what in EXACT_ROWS:
        low, high = quartiles[mode]
        print(f"{label:>6} | {statistics.median(rounds[mode]):>9.0f} | {ratio[mode]:>8.3f} | "
              f"{low:>6.3f}-{high:<6.3f}   ({what})")
    print("x plain: the median over rounds of (mode / plain in the same round); images/s: the median of each")
    print(f"CPU ms per batch | {'daemon':>7} | {'workers':>7} | {'trainer':>7}")
    for mode, label in (("plain", "plain"), *((mode, label) for mode, label, _ in EXACT_ROWS)):
        c = cpu_medians[mode]
        print(f"{label:>16} | {c['daemon']:>7.2f} | {c['workers']:>7.1f} | {c['trainer']:>7.2f}")
    print("input state per million records: " + ", ".join(f"{k} of an epoch {v} bytes" for k, v in sizes.items()))


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rounds, cpu = run_rounds(args)
    # Medians: single rounds on this shared VM swing by 15% either way, and the best of a few is an outlier.
    plain, exact, pool, exact_libzmq = (statistics.median(rounds[m]) for m in MODES)
    ratios = {m: sorted(x / p for x, p in zip(rounds[m], rounds["plain"])) for m in MODES[1:]}
    ratio = {m: statistics.median(v) for m, v in ratios.items()}
    quartiles = {m: (v[len(v) // 4], v[(3 * len(v)) // 4]) for m, v in ratios.items()}
    sizes = state_sizes()
    # Where the CPU goes (medians over rounds): the producer daemon (forwarding thread, libzmq), its workers
    # (decode and augment: the bulk, and what swings with the machine), the trainer (receive, steps).
    cpu_medians = {mode: {part: statistics.median(r[part] for r in cpu[mode]) for part in ("daemon", "workers", "trainer")}
                   for mode in cpu}
    print_table(args, rounds, ratio, quartiles, cpu_medians, sizes)
    result = {"benchmark": "exact_cost", "plain_images_per_s": plain, "exact_images_per_s": exact,
              "ratio": ratio["exact"], "ratio_quartiles": quartiles["exact"], "target_ratio": 0.97,
              "pool_images_per_s": pool, "pool_ratio": ratio["exact_pool"], "pool_ratio_quartiles": quartiles["exact_pool"],
              "exact_libzmq_images_per_s": exact_libzmq, "exact_libzmq_ratio": ratio["exact_libzmq"],
              "exact_libzmq_ratio_quartiles": quartiles["exact_libzmq"],
              "ratio_of_medians": exact / plain, "rounds": rounds, "cpu_ms_per_batch": cpu_medians,
              "cpu_rounds": cpu,
              "state_bytes_per_million_records": sizes, "batch_size": args.batch_size,
              "image_size": args.image_size, "workers": args.workers, **machine_info()}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
