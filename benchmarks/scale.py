#!/usr/bin/env python3
"""Many producers, several trainers: what grows with the size of a job, measured on one machine.

Tiny samples (8 x 8 x 3 pixels, batches of 32, through benchmarks/checksum_pipeline.py) so the
CPU goes to the control and receive paths, not to pixels. On loopback:

1. start-up: ``--producers`` (32) ``stoker produce`` daemons started at once, seconds until all serve;
2. fan-in: one trainer (``BatchStream``, default receive path) connected to 1, 8 and 32 of them:
   seconds from its start until every producer it connects to delivered a batch (connection
   set-up), its CPU milliseconds per batch and its batches/s, and its threads;
3. several trainers: 1, 2 and 4 trainer processes at once, each connected to every producer
   (each producer's PUSH deals its batches out among them): the same per trainer;
4. exact mode: the same producers with ``--exact``, one trainer with fan-in 1 and all: control
   messages and bytes per batch each way (hellos, credits with consumed-record reports,
   heartbeats; status messages), and per second;
5. exact-mode input state at 1.28 M, 100 M and 1 B records, split in as many streams as there
   are producers, in its worst case under the one-epoch-ahead bound: one epoch half consumed in
   random order (incompressible) and the next begun (1 %). Serialised bytes (what goes into each
   checkpoint, and what every hello carries), the bitmaps' memory, and the time to write and
   read it back; a size the reader refuses is reported with its error.

Prints tables and writes JSON (default benchmarks/results/scale.json); docs/performance.md
projects from these figures to 256 producer hosts x 64 trainer hosts.
Run:  python benchmarks/scale.py [--producers 32] [--fan-in 1,8,32] [--trainers 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from harness import (add_out_argument, benchmark_parser, launch_sharded, machine_info, own_cpu_seconds,
                     producer_flags, write_results)

HERE = Path(__file__).resolve().parent
SIZE, BATCH = 8, 32


# ---- one trainer (a subprocess) ----------------------------------------------------------------

def trainer(addresses: list[str], warmup: int, batches: int, exact: bool, setup_timeout: float) -> dict[str, Any]:
    """Receive from ``addresses`` through BatchStream; the figures of one trainer process."""
    from stoker.consumer.numpy.batch_stream import BatchStream

    started = time.perf_counter()
    with BatchStream(addresses, exact=exact, recv_timeout=120) as stream:
        it = iter(stream)
        seen_all = None
        while seen_all is None and time.perf_counter() - started < setup_timeout:
            next(it)
            if len(stream.stats.per_producer) >= len(addresses):
                seen_all = time.perf_counter() - started
        for _ in range(warmup):
            next(it)
        before, cpu0, t0 = stream.stats, own_cpu_seconds(), time.perf_counter()
        for _ in range(batches):
            next(it)
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - cpu0
        after = stream.stats
        threads = threading.active_count()
    n = after.batches - before.batches  # delivered into the queue meanwhile (>= what was taken)
    return {"producers": len(addresses), "setup_s": seen_all, "producers_seen": len(after.per_producer),
            "batches": batches, "batches_per_s": batches / seconds, "cpu_ms_per_batch": 1000 * cpu / batches,
            "threads": threads, "receive": stream.receive,
            "control_sent_per_batch": (after.control_sent - before.control_sent) / n if n else 0.0,
            "control_bytes_sent_per_batch": (after.control_bytes_sent - before.control_bytes_sent) / n if n else 0.0,
            "control_received_per_batch": (after.control_received - before.control_received) / n if n else 0.0,
            "control_bytes_received_per_batch": (after.control_bytes_received - before.control_bytes_received) / n
            if n else 0.0,
            "control_sent_per_s": (after.control_sent - before.control_sent) / seconds,
            "control_received_per_s": (after.control_received - before.control_received) / seconds}


def run_trainers(count: int, addresses: list[str], warmup: int, batches: int, exact: bool) -> list[dict[str, Any]]:
    """``count`` trainer processes at once, each connected to ``addresses``."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(count):
            out = Path(tmp) / f"trainer{i}.json"
            procs.append((out, subprocess.Popen(
                [sys.executable, __file__, "--trainer", ",".join(addresses), "--warmup", str(warmup), "--batches",
                 str(batches), "--result", str(out), *(["--exact"] if exact else [])],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        results = []
        for out, proc in procs:
            try:
                _, err = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise RuntimeError("a trainer took over 600 s") from None
            if proc.returncode != 0:
                raise RuntimeError(f"a trainer exited {proc.returncode}: {err[-3000:]}")
            results.append(json.loads(out.read_text()))
        return results


# ---- producers ---------------------------------------------------------------------------------

def start_producers(stack: ExitStack, lmdb: Path, count: int, exact: bool) -> tuple[list[str], float]:
    """``count`` producer daemons started at once; their addresses and the seconds until all serve."""
    flags = ["--pipeline", f"{HERE / 'checksum_pipeline.py'}:make_pipeline", "--pipeline-arg", f"size={SIZE}",
             *producer_flags(BATCH, seed=0), *(["--exact"] if exact else [])]
    t0 = time.perf_counter()
    producers = launch_sharded(stack, lmdb, count, flags, parallel=True, start_timeout=600)
    return [p.endpoint for p in producers], time.perf_counter() - t0


# ---- exact-mode state --------------------------------------------------------------------------

def state_size(records: int, streams: int) -> dict[str, Any]:
    """The worst-case input state of a dataset of ``records`` split in ``streams`` shards (module doc)."""
    import numpy as np

    from stoker.consumer.exact.state import SavedState, pack_state, parse_state
    from stoker.protocol.input_state import InputState, StreamKey, StreamProgress

    rng = np.random.default_rng(0)
    state = InputState()
    memory = 0
    for i in range(streams):
        key = StreamKey(i, streams, records, seed=0)
        size = key.size
        half = np.unpackbits(rng.integers(0, 256, (size + 7) // 8, dtype=np.uint8), count=size).astype(bool)
        begun = np.zeros(size, bool)
        begun[rng.choice(size, size // 100, replace=False) if size < 10_000_000 else
              rng.integers(0, size, size // 100)] = True
        state.streams[str(key)] = StreamProgress(size, completed=3, open={3: half, 4: begun})
        memory += half.nbytes + begun.nbytes
    t0 = time.perf_counter()
    data = pack_state(SavedState("trainer-0", state))
    write_s = time.perf_counter() - t0
    out: dict[str, Any] = {"records": records, "streams": streams, "state_bytes": len(data),
                           "bits_per_record": 8 * len(data) / records, "bitmap_memory_bytes": memory,
                           "write_s": write_s}
    t0 = time.perf_counter()
    try:
        back = parse_state(data).state
        out["read_s"] = time.perf_counter() - t0
        out["read_back_equal"] = all(np.array_equal(back.streams[k].open[e], p.open[e])
                                     for k, p in state.streams.items() for e in p.open)
    except ValueError as exc:
        out["read_s"] = None
        out["refused"] = str(exc)
    return out


# ---- the run -----------------------------------------------------------------------------------

def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--producers", type=int, default=32, help="producer daemons (each with one worker)")
    parser.add_argument("--fan-in", default="1,8,32", help="producers one trainer connects to, comma-separated")
    parser.add_argument("--trainers", default="1,2,4", help="trainer processes at once, comma-separated")
    parser.add_argument("--warmup", type=int, default=50, help="batches before timing")
    parser.add_argument("--batches", type=int, default=1000, help="batches timed per trainer")
    parser.add_argument("--state-records", default="1280000,100000000,1000000000",
                        help="dataset sizes for the exact-mode state, comma-separated")
    parser.add_argument("--skip-exact", action="store_true", help="leave out part 4 (exact mode's control plane)")
    add_out_argument(parser, "scale.json")
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: be one trainer process
    parser.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def run_parts(args, result: dict[str, Any]) -> None:
    """Parts 1 to 4 (module doc) on one tiny LMDB, into ``result``."""
    from checksum_pipeline import checksum_weights  # noqa: F401  (fails early if the pipeline is missing)
    from stoker.producer.dataset.build.write_records import write_lmdb

    fan_in = [n for n in (int(x) for x in args.fan_in.split(",")) if n <= args.producers]
    counts = [int(x) for x in args.trainers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        lmdb = Path(tmp) / "tiny"
        records = max(4096, args.producers * BATCH * 4)
        write_lmdb(lmdb, ({"pixels": bytes([i % 256]) * (SIZE * SIZE * 3), "label": i % 10} for i in range(records)),
                   progress=False, total=records)
        with ExitStack() as stack:
            addresses, start_s = start_producers(stack, lmdb, args.producers, exact=False)
            result["producer_start_s"] = start_s
            print(f"{args.producers} producers serving after {start_s:.1f} s", flush=True)
            result["fan_in"] = [run_trainers(1, addresses[:n], args.warmup, args.batches, False)[0] for n in fan_in]
            result["trainers"] = []
            for count in counts:
                rows = run_trainers(count, addresses, args.warmup, args.batches // count, False)
                result["trainers"].append({"trainers": count, "per_trainer": rows})
        if not args.skip_exact:
            with ExitStack() as stack:
                addresses, start_s = start_producers(stack, lmdb, args.producers, exact=True)
                result["exact_producer_start_s"] = start_s
                result["exact"] = [run_trainers(1, addresses[:n], args.warmup, args.batches, True)[0]
                                   for n in sorted({1, args.producers})]


def print_tables(args, result: dict[str, Any]) -> None:
    print(f"\nscale: {args.producers} producers (1 worker each, batches of {BATCH} x {SIZE}x{SIZE}x3), loopback, "
          f"{os.cpu_count()} cores; producers up after {result['producer_start_s']:.1f} s")
    print(f"{'trainers':>8} | {'fan-in':>6} | {'set-up s':>8} | {'batches/s':>9} | {'CPU ms/batch':>12} | {'threads':>7}")
    print("-" * 66)
    for r in result["fan_in"]:
        print(f"{1:>8} | {r['producers']:>6} | {r['setup_s'] or float('nan'):>8.2f} | {r['batches_per_s']:>9.0f} | "
              f"{r['cpu_ms_per_batch']:>12.3f} | {r['threads']:>7}")
    for t in result["trainers"]:
        rows = t["per_trainer"]
        print(f"{t['trainers']:>8} | {rows[0]['producers']:>6} | "
              f"{max(r['setup_s'] or float('nan') for r in rows):>8.2f} | "
              f"{sum(r['batches_per_s'] for r in rows):>9.0f} | "
              f"{statistics.median(r['cpu_ms_per_batch'] for r in rows):>12.3f} | {rows[0]['threads']:>7}")
    print("set-up: worst trainer; batches/s: all trainers together; CPU: median trainer")
    if "exact" in result:
        print(f"\nexact mode control plane, per batch received (and per second)")
        print(f"{'fan-in':>6} | {'sent':>5} | {'bytes sent':>10} | {'received':>8} | {'bytes recv':>10} | "
              f"{'sent/s':>7} | {'recv/s':>7} | {'CPU ms/batch':>12}")
        print("-" * 86)
        for r in result["exact"]:
            print(f"{r['producers']:>6} | {r['control_sent_per_batch']:>5.2f} | {r['control_bytes_sent_per_batch']:>10.0f} | "
                  f"{r['control_received_per_batch']:>8.2f} | {r['control_bytes_received_per_batch']:>10.0f} | "
                  f"{r['control_sent_per_s']:>7.0f} | {r['control_received_per_s']:>7.0f} | {r['cpu_ms_per_batch']:>12.3f}")
    print(f"\nexact-mode input state, worst case ({args.producers} streams, an epoch half consumed + the next begun)")
    print(f"{'records':>13} | {'state MB':>9} | {'bits/record':>11} | {'bitmaps MB':>10} | {'write s':>7} | read")
    print("-" * 80)
    for r in result["state"]:
        read = f"{r['read_s']:.2f} s" if r["read_s"] is not None else f"refused: {r['refused']}"
        print(f"{r['records']:>13,} | {r['state_bytes'] / 1e6:>9.2f} | {r['bits_per_record']:>11.3f} | "
              f"{r['bitmap_memory_bytes'] / 1e6:>10.0f} | {r['write_s']:>7.2f} | {read}")


def main() -> None:
    args = parse_args()
    if args.trainer:
        addresses = args.trainer.split(",")
        result = trainer(addresses, args.warmup, args.batches, args.exact, setup_timeout=120)
        Path(args.result).write_text(json.dumps(result))
        return
    result: dict[str, Any] = {"benchmark": "scale", "producers": args.producers, "batch_size": BATCH,
                              "image_size": SIZE, **machine_info()}
    run_parts(args, result)
    result["state"] = [state_size(int(r), args.producers) for r in args.state_records.split(",")]
    print_tables(args, result)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
