#!/usr/bin/env python3
"""Fan-in: one real trainer reading 1 to 1,024 producers of a fleet on one machine (issue 41).

The producers are a fleet (producer/fleet/: the daemon's plain serving code, one synthetic worker per endpoint,
``--processes`` processes for all of them), started once; each trial is a fresh trainer process (``BatchStream``,
the default receive path) connected to the first N endpoints, over loopback. Batches are tiny (32 images of
8 x 8 x 3), so the CPU goes to receiving, not pixels. Per trial, in the trainer process:

- receive threads: the most receive threads seen at once (``RECEIVE_THREADS``; target: at most 8), and all of
  the trainer's threads;
- set-up s: from the trainer's start until every endpoint it reads delivered a batch (target: within 10 s);
- CPU ms per batch over ``--batches`` batches after ``--warmup`` (target: at most 1.2x the figure for one
  producer); the ratio is taken within each round, against that round's fan-in 1;
- batches/s taken from the stream.

Trials run in interleaved rounds (every fan-in once per round, the order reversed every other round); the table
shows medians over rounds. Then the same in exact mode (fixed shards ``I/N``, endless), with the trainer's
control bytes: per batch each way (credits, consumed-record reports, acks, work), and apart, liveness (heartbeats
sent, statuses received) as bytes/s per connection, each counted by kind where it is sent or read, over the timed
batches (the queue is not full, so statuses are read as they come); and the heartbeats of ``--idle`` seconds in
which no batch is consumed (a connection with no other traffic: the most heartbeats cost).
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


# The plain loop's threads and its delivery thread, as tests/consumer/test_receive_loop.py counts them, and exact
# mode's link loops; the receive core's own thread ("stoker-receive", which runs the receiver) is counted in
# "threads" with every other thread of the trainer.
RECEIVE_THREADS = ("stoker-receive-", "stoker-exact-")


def _receive_threads() -> int:
    return sum(t.name.startswith(RECEIVE_THREADS) for t in threading.enumerate())


def _control(stream: Any) -> tuple[int, int, int, int]:
    """Control bytes ``(sent, received, heartbeats sent, statuses received)`` by the trainer so far (exact mode; 0 in
    plain mode): the first two include the last two."""
    stats = stream.stats
    return stats.control_bytes_sent, stats.control_bytes_received, stats.liveness_bytes_sent, \
        stats.liveness_bytes_received


def trainer(addresses: list[str], warmup: int, batches: int, setup_timeout: float, exact: bool = False,
            idle_s: float = 0.0) -> dict[str, Any]:
    """One trainer process's figures, reading ``addresses`` through ``BatchStream``. ``idle_s`` (exact mode): after
    the timed batches, take none for a second to let credit settle, then count the heartbeats of ``idle_s`` seconds
    more (statuses are not read while the queue is full)."""
    from stoker.consumer.numpy.batch_stream import BatchStream

    started = time.perf_counter()
    threads = 0
    with BatchStream(addresses, exact=exact, recv_timeout=120) as stream:
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
        control0, cpu0, t0 = _control(stream), own_cpu_seconds(), time.perf_counter()
        for b in range(batches):
            next(it)
            if b % 64 == 0:
                threads = max(threads, _receive_threads())
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - cpu0
        control = [after - before for after, before in zip(_control(stream), control0)]
        seen = len(stream.stats.per_producer)
        out = {"threads": threading.active_count(), "producers": len(addresses), "producers_seen": seen,
               "setup_s": setup_s, "receive_threads": threads, "batches": batches,
               "batches_per_s": batches / seconds, "cpu_ms_per_batch": 1000 * cpu / batches}
        if exact:
            per_connection_s = seconds * len(addresses)
            out.update({"liveness_sent_per_s_per_connection": control[2] / per_connection_s,  # heartbeats
                        "liveness_received_per_s_per_connection": control[3] / per_connection_s,  # statuses
                        "control_sent_per_batch": control[0] / batches,
                        "control_received_per_batch": control[1] / batches,
                        # counted by kind, not derived: credits, reports, work, hellos; and what else comes back
                        "exact_sent_per_batch": (control[0] - control[2]) / batches,
                        "exact_received_per_batch": (control[1] - control[3]) / batches})
            time.sleep(1.0)  # the queue fills, credit stops: from now on only heartbeats go out
            idle0 = _control(stream)
            time.sleep(idle_s)
            out["idle_heartbeats_per_s_per_connection"] = (_control(stream)[2] - idle0[2]) / idle_s / len(addresses)
    return out


def run_trainer(addresses: list[str], args: Any, folder: Path, exact: bool = False) -> dict[str, Any]:
    """A trainer subprocess reading ``addresses``; its figures."""
    listed, out = folder / "addresses.txt", folder / "trainer.json"
    listed.write_text("\n".join(addresses))
    done = subprocess.run([sys.executable, __file__, "--trainer", str(listed), "--warmup", str(args.warmup),
                           "--batches", str(args.batches), "--idle", str(args.idle), "--result", str(out),
                           *(["--exact"] if exact else [])], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"a trainer exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(out.read_text())


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--fan-in", default="1,16,64,256,1024", help="producers one trainer reads, comma-separated")
    parser.add_argument("--exact-fan-in", default="1,16,64,256,1024",
                        help="the same in exact mode (fixed shards), comma-separated; empty: no exact mode")
    parser.add_argument("--processes", type=int, default=2, help="fleet processes serving all the endpoints")
    parser.add_argument("--records", type=int, default=256, help="records per endpoint's shard")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every fan-in")
    parser.add_argument("--warmup", type=int, default=200, help="batches taken before timing")
    parser.add_argument("--batches", type=int, default=3000, help="batches timed per trial")
    parser.add_argument("--idle", type=float, default=3.0,
                        help="exact mode: seconds with no batch consumed whose heartbeats are counted")
    add_out_argument(parser, "fan_in.json")
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: be one trainer (a file of addresses)
    parser.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def measure(args, fan_in: list[int], exact: bool) -> dict[str, Any]:
    """A fleet of ``max(fan_in)`` endpoints, and a trainer per fan-in per round; the trials and their medians."""
    from stoker.producer.fleet.launcher import FleetProcesses

    mode = "exact" if exact else "plain"
    flags = ["--records", str(args.records), "--batch-size", str(BATCH), "--image-size", str(SIZE),
             *(["--exact"] if exact else [])]
    t0 = time.perf_counter()
    with FleetProcesses(max(fan_in), min(args.processes, max(fan_in)), flags, start_timeout=300) as fleet, \
            tempfile.TemporaryDirectory() as tmp:
        start_s = time.perf_counter() - t0
        print(f"{mode}: {len(fleet.addresses)} endpoints serving after {start_s:.1f} s", flush=True)
        trials = []
        for r in range(args.rounds):
            for n in (fan_in if r % 2 == 0 else fan_in[::-1]):
                trial = {"round": r, **run_trainer(fleet.addresses[:n], args, Path(tmp), exact)}
                print(f"{mode} round {r}: fan-in {n}: {trial['cpu_ms_per_batch']:.3f} CPU ms/batch, "
                      f"{trial['receive_threads']} receive threads, set-up {trial['setup_s']}", flush=True)
                trials.append(trial)
    return {"fleet_start_s": start_s, "trials": trials,
            "rows": [summary(n, [t for t in trials if t["producers"] == n], trials) for n in fan_in]}


def summary(n: int, mine: list[dict[str, Any]], trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds for fan-in ``n``; CPU per batch as a ratio to the same round's fan-in 1 (if run)."""
    ones = {t["round"]: t["cpu_ms_per_batch"] for t in trials if t["producers"] == 1}
    ratios = [t["cpu_ms_per_batch"] / ones[t["round"]] for t in mine if t["round"] in ones]
    setups = [t["setup_s"] for t in mine if t["setup_s"] is not None]
    row = {"producers": n, "rounds": len(mine), "receive_threads": max(t["receive_threads"] for t in mine),
           "all_delivered": all(t["producers_seen"] == n for t in mine),
           "setup_s_median": statistics.median(setups) if setups else None,
           "setup_s_max": max(setups) if len(setups) == len(mine) else None,
           "cpu_ms_per_batch": statistics.median(t["cpu_ms_per_batch"] for t in mine),
           "cpu_ms_spread": [min(t["cpu_ms_per_batch"] for t in mine), max(t["cpu_ms_per_batch"] for t in mine)],
           "cpu_ratio_to_1": statistics.median(ratios) if ratios else None,
           "batches_per_s": statistics.median(t["batches_per_s"] for t in mine)}
    for key in ("control_sent_per_batch", "control_received_per_batch", "exact_sent_per_batch",
                "exact_received_per_batch", "liveness_sent_per_s_per_connection",
                "liveness_received_per_s_per_connection", "idle_heartbeats_per_s_per_connection"):
        if key in mine[0]:
            row[key] = statistics.median(t[key] for t in mine)
    return row


def print_table(mode: str, part: dict[str, Any], result: dict[str, Any]) -> None:
    rows = part["rows"]
    print(f"\nfan-in ({mode} mode): one trainer reading a fleet of {max(r['producers'] for r in rows)} endpoints in "
          f"{result['fleet_processes']} processes, batches of {BATCH} x {SIZE}x{SIZE}x3, loopback, {result['cpus']} "
          f"cores; fleet serving after {part['fleet_start_s']:.1f} s; medians of {rows[0]['rounds']} rounds")
    exact = "exact_sent_per_batch" in rows[0]
    print(f"{'fan-in':>6} | {'recv threads':>12} | {'set-up s (max)':>14} | {'CPU ms/batch':>12} | "
          f"{'x fan-in 1':>10} | {'batches/s':>9}"
          + (" | ctl B/batch sent, recv | live B/s/conn sent, recv | idle hb B/s/conn" if exact else ""))
    print("-" * (80 + 70 * exact))
    for r in rows:
        setup = f"{r['setup_s_median']:.2f} ({r['setup_s_max']:.2f})" if r["setup_s_max"] is not None else "not all"
        ratio = f"{r['cpu_ratio_to_1']:.2f}" if r["cpu_ratio_to_1"] is not None else "-"
        line = (f"{r['producers']:>6} | {r['receive_threads']:>12} | {setup:>14} | {r['cpu_ms_per_batch']:>12.3f} | "
                f"{ratio:>10} | {r['batches_per_s']:>9.0f}")
        if exact:
            line += (f" | {r['exact_sent_per_batch']:>9.0f}, {r['exact_received_per_batch']:>9.0f} | "
                     f"{r['liveness_sent_per_s_per_connection']:>11.1f}, "
                     f"{r['liveness_received_per_s_per_connection']:>9.1f} | "
                     f"{r['idle_heartbeats_per_s_per_connection']:>16.1f}")
        print(line)
    print("set-up: until every endpoint read delivered a batch; x fan-in 1: median of each round's ratio")
    if exact:
        print("ctl B/batch: control bytes per batch (credits, reports, work, hellos), liveness counted apart; live "
              "B/s/conn: heartbeats sent and statuses read per connection over the timed batches; idle hb: "
              "heartbeats per connection while nothing is consumed")


def run(args) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "fan_in", "batch_size": BATCH, "image_size": SIZE,
                              "fleet_processes": args.processes, **machine_info()}
    result["plain"] = measure(args, [int(x) for x in args.fan_in.split(",")], exact=False)
    if args.exact_fan_in:
        result["exact"] = measure(args, [int(x) for x in args.exact_fan_in.split(",")], exact=True)
    return result


def main() -> None:
    args = parse_args()
    if args.trainer:
        addresses = Path(args.trainer).read_text().split()
        figures = trainer(addresses, args.warmup, args.batches, setup_timeout=60, exact=args.exact, idle_s=args.idle)
        Path(args.result).write_text(json.dumps(figures))
        return
    result = run(args)
    for mode in ("plain", "exact"):
        if mode in result:
            print_table(mode, result[mode], result)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
