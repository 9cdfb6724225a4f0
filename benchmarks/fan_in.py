#!/usr/bin/env python3
"""Fan-in: one real trainer reading 1 to 1,024 producers of a fleet on one machine (issue 41).

The producers are a fleet (producer/fleet/: the daemon's plain serving code, one synthetic worker per endpoint,
``--processes`` processes for all of them), started once; each trial is a fresh trainer process (``BatchStream``,
the default receive path) connected to the first N endpoints, over loopback. Batches are tiny (32 images of
8 x 8 x 3), so the CPU goes to receiving, not pixels. Per trial, in the trainer process:

- receive threads: the most ``stoker-receive-*`` threads seen at once (target: at most 8);
- set-up s: from the trainer's start until every endpoint it reads delivered a batch (target: within 10 s);
- CPU ms per batch over ``--batches`` batches after ``--warmup`` (target: at most 1.2x the figure for one
  producer); the ratio is taken within each round, against that round's fan-in 1;
- batches/s taken from the stream.

Trials run in interleaved rounds (every fan-in once per round, the order reversed every other round); the table
shows medians over rounds. Plain mode only: the fleet serves no exact mode yet, so control bytes per batch and
liveness bytes per connection are not measured here.
Prints a table and writes JSON (default benchmarks/results/fan_in.json).
Run:  python benchmarks/fan_in.py [--fan-in 1,16,64,256,1024] [--processes 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import add_out_argument, benchmark_parser, machine_info, own_cpu_seconds, write_results

BATCH, SIZE = 32, 8


def _receive_threads() -> int:
    return sum(t.name.startswith("stoker-receive-") for t in threading.enumerate())


def trainer(addresses: list[str], warmup: int, batches: int, setup_timeout: float) -> dict[str, Any]:
    """One trainer process's figures, reading ``addresses`` through ``BatchStream``."""
    from stoker.consumer.numpy.batch_stream import BatchStream

    started = time.perf_counter()
    threads = 0
    with BatchStream(addresses, recv_timeout=120) as stream:
        it = iter(stream)
        setup_s = None
        while time.perf_counter() - started < setup_timeout:
            next(it)
            threads = max(threads, _receive_threads())
            if len(stream.stats.per_producer) >= len(addresses):
                setup_s = time.perf_counter() - started
                break
        for _ in range(warmup):
            next(it)
        cpu0, t0 = own_cpu_seconds(), time.perf_counter()
        for b in range(batches):
            next(it)
            if b % 64 == 0:
                threads = max(threads, _receive_threads())
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - cpu0
        seen = len(stream.stats.per_producer)
    return {"producers": len(addresses), "producers_seen": seen, "setup_s": setup_s, "receive_threads": threads,
            "batches": batches, "batches_per_s": batches / seconds, "cpu_ms_per_batch": 1000 * cpu / batches}


def run_trainer(addresses: list[str], warmup: int, batches: int, folder: Path) -> dict[str, Any]:
    """A trainer subprocess reading ``addresses``; its figures."""
    listed, out = folder / "addresses.txt", folder / "trainer.json"
    listed.write_text("\n".join(addresses))
    done = subprocess.run([sys.executable, __file__, "--trainer", str(listed), "--warmup", str(warmup), "--batches",
                           str(batches), "--result", str(out)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"a trainer exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(out.read_text())


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--fan-in", default="1,16,64,256,1024", help="producers one trainer reads, comma-separated")
    parser.add_argument("--processes", type=int, default=2, help="fleet processes serving all the endpoints")
    parser.add_argument("--records", type=int, default=256, help="records per endpoint's shard")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every fan-in")
    parser.add_argument("--warmup", type=int, default=200, help="batches taken before timing")
    parser.add_argument("--batches", type=int, default=3000, help="batches timed per trial")
    add_out_argument(parser, "fan_in.json")
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: be one trainer (a file of addresses)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def run(args) -> dict[str, Any]:
    from stoker.producer.fleet.launcher import FleetProcesses

    fan_in = [int(x) for x in args.fan_in.split(",")]
    result: dict[str, Any] = {"benchmark": "fan_in", "mode": "plain", "batch_size": BATCH, "image_size": SIZE,
                              "fleet_processes": args.processes, "endpoints": max(fan_in), **machine_info()}
    t0 = time.perf_counter()
    with FleetProcesses(max(fan_in), min(args.processes, max(fan_in)),
                        ["--records", str(args.records), "--batch-size", str(BATCH), "--image-size", str(SIZE)],
                        start_timeout=300) as fleet, tempfile.TemporaryDirectory() as tmp:
        result["fleet_start_s"] = time.perf_counter() - t0
        print(f"{len(fleet.addresses)} endpoints serving after {result['fleet_start_s']:.1f} s", flush=True)
        trials = []
        for r in range(args.rounds):
            for n in (fan_in if r % 2 == 0 else fan_in[::-1]):
                trial = {"round": r, **run_trainer(fleet.addresses[:n], args.warmup, args.batches, Path(tmp))}
                print(f"round {r}: fan-in {n}: {trial['cpu_ms_per_batch']:.3f} CPU ms/batch, "
                      f"{trial['receive_threads']} receive threads, set-up {trial['setup_s']}", flush=True)
                trials.append(trial)
    result["trials"] = trials
    result["rows"] = [summary(n, [t for t in trials if t["producers"] == n], trials) for n in fan_in]
    return result


def summary(n: int, mine: list[dict[str, Any]], trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds for fan-in ``n``; CPU per batch as a ratio to the same round's fan-in 1 (if run)."""
    ones = {t["round"]: t["cpu_ms_per_batch"] for t in trials if t["producers"] == 1}
    ratios = [t["cpu_ms_per_batch"] / ones[t["round"]] for t in mine if t["round"] in ones]
    setups = [t["setup_s"] for t in mine if t["setup_s"] is not None]
    return {"producers": n, "rounds": len(mine),
            "receive_threads": max(t["receive_threads"] for t in mine),
            "all_delivered": all(t["producers_seen"] == n for t in mine),
            "setup_s_median": statistics.median(setups) if setups else None,
            "setup_s_max": max(setups) if len(setups) == len(mine) else None,
            "cpu_ms_per_batch": statistics.median(t["cpu_ms_per_batch"] for t in mine),
            "cpu_ms_spread": [min(t["cpu_ms_per_batch"] for t in mine), max(t["cpu_ms_per_batch"] for t in mine)],
            "cpu_ratio_to_1": statistics.median(ratios) if ratios else None,
            "batches_per_s": statistics.median(t["batches_per_s"] for t in mine)}


def print_table(result: dict[str, Any]) -> None:
    print(f"\nfan-in (plain mode): one trainer reading a fleet of {result['endpoints']} endpoints in "
          f"{result['fleet_processes']} processes, batches of {BATCH} x {SIZE}x{SIZE}x3, loopback, {result['cpus']} "
          f"cores; fleet serving after {result['fleet_start_s']:.1f} s; medians of {result['rows'][0]['rounds']} rounds")
    print(f"{'fan-in':>6} | {'recv threads':>12} | {'set-up s (max)':>14} | {'CPU ms/batch':>12} | {'x fan-in 1':>10} | "
          f"{'batches/s':>9}")
    print("-" * 80)
    for r in result["rows"]:
        setup = f"{r['setup_s_median']:.2f} ({r['setup_s_max']:.2f})" if r["setup_s_max"] is not None else "not all"
        ratio = f"{r['cpu_ratio_to_1']:.2f}" if r["cpu_ratio_to_1"] is not None else "-"
        print(f"{r['producers']:>6} | {r['receive_threads']:>12} | {setup:>14} | {r['cpu_ms_per_batch']:>12.3f} | "
              f"{ratio:>10} | {r['batches_per_s']:>9.0f}")
    print("set-up: until every endpoint read delivered a batch; x fan-in 1: median of each round's ratio")


def main() -> None:
    args = parse_args()
    if args.trainer:
        addresses = Path(args.trainer).read_text().split()
        Path(args.result).write_text(json.dumps(trainer(addresses, args.warmup, args.batches, setup_timeout=60)))
        return
    result = run(args)
    print_table(result)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
