#!/usr/bin/env python3
"""A partitioned job: 16 trainers each reading 64 of a 1,024-producer elastic pool, one exact epoch (issue 41).

The producers are a fleet (producer/fleet/, ``--pool``: the daemon's own pool policy and exact forwarder, a synthetic
worker per endpoint) in ``--processes`` processes; the trainers are ``--trainers`` real processes, each a
``BatchStream(exact=True, share=(r, W))`` over ``partition(addresses, r, W, per_trainer=k)``
(consumer/exact/pool/partition.py), all started together and read to the end of the epoch. Batches are tiny
(32 images of 8 x 8 x 3), so the CPU goes to receiving and exact bookkeeping, not pixels. Reported:

- connections: TCP connections the trainers hold (the most each held, counted in /proc every 32 batches), against
  ``k x W`` asked and ``N x W`` of full fan-in; producers joined and left, reconnects (a connection replaced
  briefly holds two);
- per trainer (median and worst): CPU ms per batch over its whole epoch (set-up included) and from the moment
  every producer it reads delivered to the end (steady), receive threads (the most seen at
  once), seconds from the trainers' start until every producer it reads delivered a batch;
- seconds from the trainers' start until every producer of the fleet served some trainer;
- records: each trainer's (epoch, index) pairs are gathered and checked: every record of the dataset once.

Prints a summary and writes JSON (default benchmarks/results/partition.json).
Run:  python benchmarks/partition.py [--producers 1024 --trainers 16 --per-trainer 64 --processes 4]
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
from pathlib import Path
from typing import Any

import numpy as np

from harness import add_out_argument, benchmark_parser, machine_info, own_cpu_seconds, write_results

BATCH, SIZE = 32, 8
RECEIVE_THREADS = ("stoker-receive-", "stoker-exact-")  # as benchmarks/fan_in.py counts them


def _receive_threads() -> int:
    return sum(t.name.startswith(RECEIVE_THREADS) for t in threading.enumerate())


def established_tcp() -> int:
    """TCP connections of this process that are established (its socket inodes in /proc/net/tcp, state 01)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                count += fields[3] == "01" and fields[9] in inodes
    return count


def trainer(addresses: list[str], rank: int, world: int, started: float, rows_path: Path) -> dict[str, Any]:
    """One trainer of the job: its share of the epoch to the end, its figures; its rows saved to ``rows_path``."""
    from stoker.consumer.numpy.batch_stream import BatchStream

    cpu0, batches, threads, all_at, connections, steady = own_cpu_seconds(), 0, 0, None, 0, None
    epochs, indices = [], []
    with BatchStream(addresses, exact=True, share=(rank, world), recv_timeout=300) as stream:
        for batch in stream:
            batches += 1
            epochs.append(batch["epoch"].astype(np.int64))
            indices.append(batch["index"].astype(np.int64))
            if all_at is None and len(stream.stats.per_producer) >= len(addresses):
                all_at, steady = time.time() - started, (own_cpu_seconds(), batches)
            if batches % 32 == 1:
                threads, connections = max(threads, _receive_threads()), max(connections, established_tcp())
        stats = stream.stats
        seen = sorted(stats.per_producer)
        links = {"reconnects": stats.reconnects, "producers_joined": stats.producers_joined,
                 "producers_left": stats.producers_left, "handshake_failures": stats.handshake_failures}
    cpu_end = own_cpu_seconds()
    cpu = cpu_end - cpu0
    steady_ms = 1000 * (cpu_end - steady[0]) / (batches - steady[1]) if steady and batches > steady[1] else None
    np.save(rows_path, np.stack([np.concatenate(epochs), np.concatenate(indices)]) if batches else
            np.zeros((2, 0), np.int64), allow_pickle=False)
    return {"rank": rank, "producers": len(addresses), "producers_seen": seen, "batches": batches,
            "cpu_ms_per_batch": 1000 * cpu / max(1, batches), "steady_cpu_ms_per_batch": steady_ms,
            "receive_threads": threads,
            "all_delivered_s": all_at, "connections": connections, "ended_s": time.time() - started, **links}


def run_job(args: Any) -> dict[str, Any]:
    """The fleet, then the trainers together; their figures, and the job's records checked."""
    from stoker.consumer.exact.pool.partition import partition, readers
    from stoker.producer.fleet.launcher import FleetProcesses

    flags = ["--records", str(args.records), "--batch-size", str(BATCH), "--image-size", str(SIZE), "--pool",
             "--epoch-order", str(args.epoch_order), "--epochs", "1"]
    t0 = time.perf_counter()
    with FleetProcesses(args.producers, args.processes, flags, start_timeout=300) as fleet, \
            tempfile.TemporaryDirectory() as tmp:
        start_s = time.perf_counter() - t0
        print(f"pool fleet: {args.producers} endpoints in {args.processes} processes serving after {start_s:.1f} s",
              flush=True)
        producer_of = {line["endpoint"]: line["producer_id"] for line in fleet.serving}
        folder, started, procs = Path(tmp), time.time(), []
        for r in range(args.trainers):
            listed = folder / f"addresses{r}.txt"
            listed.write_text("\n".join(partition(fleet.addresses, r, args.trainers, args.per_trainer)))
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--trainer", str(listed), "--rank", str(r), "--world", str(args.trainers),
                 "--started", repr(started), "--result", str(folder / f"trainer{r}")],
                stdout=subprocess.DEVNULL, stderr=open(folder / f"trainer{r}.log", "wb")))
        for r, proc in enumerate(procs):
            if proc.wait(timeout=900) != 0:
                raise RuntimeError(f"trainer {r} exited {proc.returncode}: "
                                   + (folder / f"trainer{r}.log").read_text(errors="replace")[-3000:])
        trainers = [json.loads((folder / f"trainer{r}.json").read_text()) for r in range(args.trainers)]
        rows = np.concatenate([np.load(folder / f"trainer{r}.npy") for r in range(args.trainers)], axis=1)
    records = args.producers * args.records
    counts = np.bincount(rows[1], minlength=records) if rows.shape[1] else np.zeros(records, np.int64)
    served = set().union(*(t["producers_seen"] for t in trainers))
    return {"fleet_start_s": start_s, "trainers": trainers,
            "readers_per_producer": sorted(set(readers(args.producers, args.trainers, args.per_trainer))),
            "connections_asked": args.trainers * args.per_trainer, "connections_full_fan_in":
                args.trainers * args.producers,
            "connections_counted": sum(t["connections"] for t in trainers),
            **{key: sum(t[key] for t in trainers) for key in ("reconnects", "producers_joined", "producers_left",
                                                               "handshake_failures")},
            "producers_served": len(served & set(producer_of.values())),
            "every_producer_served_s": max((t["all_delivered_s"] for t in trainers), default=None)
            if all(t["all_delivered_s"] is not None for t in trainers) else None,
            "records": records, "records_once": int((counts == 1).sum()), "records_twice_or_more":
                int((counts > 1).sum()), "records_never": int((counts == 0).sum()),
            "rows_of_other_epochs": int((rows[0] != 0).sum())}


def print_summary(result: dict[str, Any]) -> None:
    job, trainers = result["job"], result["job"]["trainers"]

    def spread(key: str, fmt: str) -> str:
        values = [t[key] for t in trainers if t[key] is not None]
        return f"median {statistics.median(values):{fmt}}, worst {max(values):{fmt}}" if values else "none"

    print(f"\npartitioned pool: {result['trainers']} trainers x {result['per_trainer']} of {result['producers']} "
          f"producers ({job['readers_per_producer']} trainers per producer), epoch order {result['epoch_order']}, "
          f"{job['records']:,} records, batches of {BATCH} x {SIZE}x{SIZE}x3, {result['cpus']} cores")
    print(f"connections: {job['connections_counted']} counted ({job['connections_asked']} asked; full fan-in would "
          f"be {job['connections_full_fan_in']}); producers joined {job['producers_joined']}, left "
          f"{job['producers_left']}, reconnects {job['reconnects']}, failed handshakes {job['handshake_failures']}")
    print(f"per trainer: CPU ms/batch {spread('cpu_ms_per_batch', '.3f')} (set-up included; once all its producers "
          f"delivered: {spread('steady_cpu_ms_per_batch', '.3f')}); receive threads "
          f"{spread('receive_threads', 'g')}; its producers all delivered after s {spread('all_delivered_s', '.1f')}"
          f"; epoch ended after s {spread('ended_s', '.1f')}")
    every = job["every_producer_served_s"]
    print(f"every producer served: {job['producers_served']} of {result['producers']}"
          + (f", all within {every:.1f} s of the trainers' start" if every is not None else ""))
    print(f"records: {job['records_once']:,} once, {job['records_twice_or_more']} twice or more, "
          f"{job['records_never']} never (of {job['records']:,}); rows of other epochs {job['rows_of_other_epochs']}")


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--producers", type=int, default=1024, help="pool endpoints of the fleet")
    parser.add_argument("--trainers", type=int, default=16, help="trainer processes of the job")
    parser.add_argument("--per-trainer", type=int, default=64, help="producers each trainer reads (k)")
    parser.add_argument("--processes", type=int, default=4, help="fleet processes serving all the endpoints")
    # 1,024: a share's epoch is cut in splits of at most 16 batches (split_plan.py), and each of a trainer's k
    # producers holds two at least: fewer records leave some producers without work.
    parser.add_argument("--records", type=int, default=1024, help="records per endpoint (the dataset: N x this)")
    parser.add_argument("--epoch-order", type=int, default=2, choices=(1, 2))
    add_out_argument(parser, "partition.json")
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: be one trainer (a file of addresses)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.trainer:
        result = Path(args.result)
        figures = trainer(Path(args.trainer).read_text().split(), args.rank, args.world, args.started,
                          result.with_suffix(".npy"))
        result.with_suffix(".json").write_text(json.dumps(figures))
        return
    result = {"benchmark": "partition", "producers": args.producers, "trainers": args.trainers,
              "per_trainer": args.per_trainer, "fleet_processes": args.processes, "epoch_order": args.epoch_order,
              "batch_size": BATCH, "image_size": SIZE, **machine_info()}
    result["job"] = run_job(args)
    print_summary(result)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
