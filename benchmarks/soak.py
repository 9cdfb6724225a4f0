#!/usr/bin/env python3
"""Soak: producers and a trainer for a fixed number of batches; memory of every process, start vs end.

Two `stoker produce` daemons (1 worker each) feed a ZMQInput in this process (the
trainer), whose tf.function step consumes each batch. RSS is read from /proc for
the trainer, each daemon and each worker after a warm-up ("start") and at the end.
Targets: growth under 5 % per process; trainer RSS under
``ZMQInput.max_batches_held() x batch bytes + step working memory + fixed overhead``.
max_batches_held counts the queue, the staged batches, the step's, the receive
thread's and ZMQ's receive buffer per producer. The step's working memory here is
two float32 copies of the batch (measured: the same run with a step that skips the
cast ends 72 MiB lower with 9.6 MB batches). The fixed overhead we state is this process's RSS
with TensorFlow and Keras loaded, before ZMQInput exists (measured in the same run),
plus a 32 MiB allowance for the ZMQ context and I/O threads, our two threads and
the traced step (--allowance-mib).

Run:  python benchmarks/soak.py [--batches 20000] [--receive direct]   (prints a table, writes JSON)
With a slow trainer the FIFOQueue fills, which checks the bound at its worst:
      python benchmarks/soak.py --batch-size 64 --image-size 224 --batches 600 --warmup 100 --step-ms 100
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from harness import (add_out_argument, benchmark_parser, launch_producer, producer_flags,  # noqa: E402
                     synthetic_lmdb, write_results)
from stoker.consumer import ZMQInput  # noqa: E402
from stoker.producer.process import ProducerProcess  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def snapshot(producers: list[ProducerProcess]) -> dict[str, float]:
    rows = {"trainer": rss_mib(os.getpid())}
    for i, p in enumerate(producers):
        rows[f"producer{i}"] = rss_mib(p.pid)
        for j, child in enumerate(sorted(p.child_pids())):
            rows[f"producer{i}.child{j}"] = rss_mib(child)
    return rows


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--queue-capacity", type=int, default=50)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="extra time per training step (a slow trainer, so the queue fills); 0: none")
    parser.add_argument("--allowance-mib", type=float, default=32.0,
                        help="stated fixed overhead beyond the TF baseline: ZMQ context, threads, traced step")
    parser.add_argument("--receive", choices=("auto", "direct", "libzmq"), default="auto", help="ZMQInput(receive=...)")
    add_out_argument(parser, "soak.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    b, s = args.batch_size, args.image_size
    batch_bytes = b * s * s * 3 + 4 * b
    with synthetic_lmdb(args.records, "soak") as lmdb_path:
        flags = [*producer_flags(b, s), "--log-interval", "60"]
        producers = [launch_producer(lmdb_path, [*flags, "--shard", f"{i}/2"]) for i in range(2)]
        try:
            fixed_overhead = rss_mib(os.getpid())
            with ZMQInput([p.endpoint for p in producers], batch_size=b, image_shape=(s, s, 3),
                          queue_capacity=args.queue_capacity, recv_timeout=60, receive=args.receive) as inp:
                @tf.function
                def step() -> tf.Tensor:
                    images, labels = inp.get()
                    return tf.reduce_mean(tf.cast(images, tf.float32)) + tf.cast(tf.reduce_sum(labels), tf.float32)

                for _ in range(args.warmup):
                    step()
                    time.sleep(args.step_ms / 1000)
                start, t0 = snapshot(producers), time.perf_counter()
                occupancy = []
                for i in range(args.batches):
                    value = step()
                    time.sleep(args.step_ms / 1000)
                    occupancy.append(inp.queue_occupancy())
                    if i % 5000 == 0:
                        print(f"  {i}/{args.batches} batches", flush=True)
                float(value)
                seconds = time.perf_counter() - t0
                end, stats = snapshot(producers), inp.stats
                held = inp.max_batches_held()
                buffers_mib = held * batch_bytes / 2**20
                step_mib = 2 * 4 * b * s * s * 3 / 2**20  # the step's working set: two float32 batch copies
                bound = fixed_overhead + args.allowance_mib + buffers_mib + step_mib
        finally:
            codes = [p.stop() for p in producers]
    rows = []
    for name in start:
        growth = (end.get(name, float("nan")) - start[name]) / start[name]
        rows.append({"process": name, "start_mib": start[name], "end_mib": end.get(name), "growth": growth})
    print(f"\nsoak: {args.batches} batches of {b}x{s}x{s}x3 in {seconds:.0f} s "
          f"({args.batches / seconds:.0f} batches/s), rejected {stats.protocol_errors + stats.mismatched_batches}, "
          f"mean queue occupancy {sum(occupancy) / len(occupancy):.2f}")
    print(f"{'process':<20} | {'start MiB':>9} | {'end MiB':>9} | {'growth':>7}")
    print("-" * 55)
    for r in rows:
        print(f"{r['process']:<20} | {r['start_mib']:>9.1f} | {r['end_mib']:>9.1f} | {100 * r['growth']:>6.2f}%")
    extra = end["trainer"] - fixed_overhead - buffers_mib - step_mib
    print(f"trainer bound: TF baseline {fixed_overhead:.1f} MiB + allowance {args.allowance_mib:.0f} MiB + "
          f"{held} batches held x {batch_bytes / 2**20:.2f} MiB + step {step_mib:.1f} MiB = "
          f"{bound:.1f} MiB; trainer end RSS {end['trainer']:.1f} MiB -> "
          f"{'within' if end['trainer'] <= bound else 'OVER'} (overhead beyond baseline and buffers: {extra:.1f} MiB)")
    result = {"benchmark": "soak", "batches": args.batches, "seconds": seconds, "rows": rows,
              "fixed_overhead_mib": fixed_overhead, "allowance_mib": args.allowance_mib,
              "measured_extra_overhead_mib": extra, "trainer_bound_mib": bound, "max_batches_held": held,
              "step_working_mib": step_mib,
              "trainer_within_bound": end["trainer"] <= bound, "batch_bytes": batch_bytes,
              "max_growth": max(r["growth"] for r in rows), "producer_exit_codes": codes,
              "rejected": stats.protocol_errors + stats.mismatched_batches, "step_ms": args.step_ms,
              "receive": args.receive,
              "mean_queue_occupancy": sum(occupancy) / len(occupancy)}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
