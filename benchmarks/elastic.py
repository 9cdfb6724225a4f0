#!/usr/bin/env python3
"""An elastic pool in one run: producers added one at a time, then one SIGKILLed and one scaled down.

One consumer (``BatchStream``, exact mode, a bare loop that only counts records) follows a pool
given as a discovery function over a list this script edits, as DNS does for a Kubernetes headless
Service. Every producer runs ``--shard auto`` (decode + random-resized crop, one worker each) and the
trainer hands out splits. Per phase it measures, after the pool changed and the newcomer delivered:

- images/s, and the cores the producers and the consumer used meanwhile (/proc);
- scaling: rate_k / rate_1 against cores_k / cores_1 (the producers' share of the cores they had):
  ``linear`` = 1.0 means each producer core delivers as much as the first did (target >= 0.9);
- for a producer that joins: seconds from its process start, and from joining the pool, to its first
  batch at the consumer.

At the end, per epoch: records seen twice (must be 0) and, for every epoch the run completed,
records never seen (must be 0); rows the trainer dropped because their record had arrived before.

Then the pool's liveness (issue 29), each on a fresh pool:

- *joining* on the demo's 1,024 records (and ``--large-records``): a third producer joins a pool of
  two; seconds from joining to its first batch (goal <= 2 s) and images/s with 2 and 3 producers;
- *stuck*: one producer of three is SIGSTOPped with its workers; seconds from the freeze to the
  completion of the epoch that was open (goal: the stall bound plus the re-served work) and what the
  re-serving cost (splits re-served, records wasted);
- *straggler*: epoch time of two healthy producers plus one at a quarter speed (paused 3/4 of the
  time) against the two alone, in interleaved rounds (goal <= 1.15x);
- every phase: records twice 0, never 0; the healthy pools' wasted records 0.
Prints a table and writes JSON (default benchmarks/results/elastic.json).
Run:  python benchmarks/elastic.py [--producers 3] [--seconds 10] [--records 3000] [--liveness-only]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import tempfile
import time
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from harness import (add_out_argument, benchmark_parser, launch_producer, producer_flags, producers_cpu_now,
                     write_results)
from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.receive.coverage import coverage_text
from stoker.consumer.exact.control_plane import pool_scheduler
from stoker.producer.process import ProducerProcess
from stoker.producer.throttle import Throttle
from stoker.producer.dataset.build.synthetic import build_synthetic


class Run:
    """The consumer loop and the pool it follows."""

    def __init__(self, lmdb: Path, args: argparse.Namespace) -> None:
        self.lmdb, self.args = lmdb, args
        self.producers: dict[str, ProducerProcess] = {}
        self.pool: list[str] = []
        self.seen: dict[int, Counter] = defaultdict(Counter)
        self.rows = 0
        self.stream: Any = None

    def start_producer(self, name: str) -> tuple[ProducerProcess, float]:
        started = time.monotonic()
        producer = launch_producer(self.lmdb, _pool_flags(self.args, name, trainer_timeout=5))
        self.producers[name] = producer
        return producer, started

    def take_one(self) -> None:
        batch = next(self.stream)
        for e, i in zip(batch["epoch"].tolist(), batch["index"].tolist()):
            self.seen[e][i] += 1
        self.rows += len(batch["index"])

    def take(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.take_one()

    def take_until(self, done, limit: float = 120.0) -> None:
        deadline = time.monotonic() + limit
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {limit:.0f} s: {self.stream.stats.per_producer}")
            self.take(0.05)

    def measure(self, label: str) -> dict[str, Any]:
        live = [p for p in self.producers.values() if p.proc.poll() is None]
        self.take(self.args.warmup)
        t0, rows0, cpu0 = time.monotonic(), self.rows, producers_cpu_now(live)
        self.take(self.args.seconds)
        seconds = time.monotonic() - t0
        used = producers_cpu_now(live) - cpu0
        return {"phase": label, "producers": len(self.pool), "images_per_s": (self.rows - rows0) / seconds,
                "producer_cores": used.producers / seconds, "consumer_cores": used.own / seconds}


def plain_join(lmdb: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Plain mode: a second producer (fixed shards 0/2 and 1/2) joins a running consumer's pool; its time to
    the first batch, images/s before and after, and each shard's epochs' coverage as the consumer reports it
    (per shard: each plain producer counts its own shard's epochs)."""
    def flags(i: int) -> list[str]:
        return producer_flags(args.batch, args.size, seed=0, shard=f"{i}/2", producer_id=f"plain{i}")

    producers = [launch_producer(lmdb, flags(0))]
    pool = [producers[0].endpoint]
    out: dict[str, Any] = {}
    try:
        with BatchStream(lambda: list(pool), recv_timeout=120, discover_every=0.2, queue_capacity=8) as stream:

            def images_per_s(seconds: float) -> float:
                t0, rows = time.monotonic(), 0
                while time.monotonic() - t0 < seconds:
                    rows += len(next(stream)["index"])
                return rows / (time.monotonic() - t0)

            images_per_s(args.warmup)
            out["images_per_s_one"] = images_per_s(args.seconds)
            started = time.monotonic()
            producers.append(launch_producer(lmdb, flags(1)))
            joined = time.monotonic()
            pool.append(producers[1].endpoint)
            while stream.stats.per_producer.get("plain1", 0) == 0:
                if time.monotonic() - joined > 120:
                    raise RuntimeError("the joining plain producer never delivered")
                next(stream)
            first = time.monotonic()
            out["start_to_first_batch_s"], out["join_to_first_batch_s"] = first - started, first - joined
            images_per_s(args.warmup)
            out["images_per_s_two"] = images_per_s(args.seconds)
            pool.remove(producers[0].endpoint)  # scaled down: the consumer goes on with the other
            producers[0].stop()
            out["images_per_s_after_leave"] = images_per_s(args.seconds)
            out["coverage"] = {}  # shard -> epoch -> [distinct records received, records in the shard]
            for (shard, e), c in stream.stats.coverage.items():
                out["coverage"].setdefault(shard, {})[str(e)] = list(c)
    finally:
        for producer in producers:
            producer.stop()
    return out


def _pool_flags(args: argparse.Namespace, name: str, epochs: int | None = None, trainer_timeout: int = 30) -> list[str]:
    """An elastic pool's producer: ``--shard auto``, one worker, named ``name``."""
    return producer_flags(args.batch, args.size, seed=0, shard="auto", producer_id=name,
                          trainer_timeout=trainer_timeout, epochs=epochs or None)


class Tally:
    """Records seen per epoch in one stream: twice and never, for the epochs it completed."""

    def __init__(self, records: int) -> None:
        self.records = records
        self.seen: dict[int, Counter] = defaultdict(Counter)
        self.rows = 0

    def take(self, stream: Any) -> None:
        batch = next(stream)
        for e, i in zip(batch["epoch"].tolist(), batch["index"].tolist()):
            self.seen[e][i] += 1
        self.rows += len(batch["index"])

    def check(self, completed: int) -> dict[str, int]:
        twice = sum(1 for c in self.seen.values() for n in c.values() if n > 1)
        never = sum(self.records - len(self.seen.get(e, ())) for e in range(completed))
        return {"epochs_completed": completed, "twice": twice, "never": never}


def _scheduler(stream: Any) -> Any:
    """The split scheduler behind an exact BatchStream of an elastic pool (None until a pool producer reported)."""
    return pool_scheduler(stream._core.receiver.control_plane)


def _completed(stream: Any) -> int:
    return _scheduler(stream).progress.completed if _scheduler(stream) is not None else 0


def _rate(stream: Any, tally: Tally, seconds: float) -> float:
    t0, rows0 = time.monotonic(), tally.rows
    while time.monotonic() - t0 < seconds:
        tally.take(stream)
    return (tally.rows - rows0) / (time.monotonic() - t0)


def joining(lmdb: Path, records: int, args: argparse.Namespace) -> dict[str, Any]:
    """A third producer joins a pool of two: seconds to its first batch, images/s before and after."""
    producers = [launch_producer(lmdb, _pool_flags(args, f"j{k}")) for k in range(2)]
    pool = [p.endpoint for p in producers]
    tally = Tally(records)
    out: dict[str, Any] = {"records": records}
    try:
        with BatchStream(lambda: list(pool), exact=True, recv_timeout=120, discover_every=0.2,
                         queue_capacity=8) as stream:
            _rate(stream, tally, args.warmup)
            cpu0, t0 = producers_cpu_now(producers), time.monotonic()
            out["images_per_s_two"] = _rate(stream, tally, args.seconds)
            cores_two = (producers_cpu_now(producers) - cpu0).producers / (time.monotonic() - t0)
            producers.append(launch_producer(lmdb, _pool_flags(args, "j2")))
            joined = time.monotonic()
            pool.append(producers[-1].endpoint)
            while stream.stats.per_producer.get("j2", 0) == 0:
                if time.monotonic() - joined > 120:
                    raise RuntimeError(f"the joining producer never delivered: {stream.stats.per_producer}")
                tally.take(stream)
            out["join_to_first_batch_s"] = time.monotonic() - joined
            _rate(stream, tally, args.warmup)
            cpu0, t0 = producers_cpu_now(producers), time.monotonic()
            out["images_per_s_three"] = _rate(stream, tally, args.seconds)
            cores_three = (producers_cpu_now(producers) - cpu0).producers / (time.monotonic() - t0)
            out["step"] = out["images_per_s_three"] / out["images_per_s_two"]
            # Linear: images/s per producer core kept (on a machine with fewer cores than producers, the cores the
            # producers could get is what grows, not their count).
            out["producer_cores"] = [cores_two, cores_three]
            out["vs_linear"] = out["step"] / (cores_three / cores_two) if cores_two and cores_three else 0.0
            out["batches_per_producer"] = dict(stream.stats.per_producer)
            out["wasted_records"] = stream.stats.wasted_records
            out.update(tally.check(_completed(stream)))
    finally:
        for p in producers:
            p.stop()
    return out


def stuck(lmdb: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One producer of three frozen: seconds until the epoch open at the freeze completes, and the cost."""
    producers = [launch_producer(lmdb, _pool_flags(args, f"s{k}")) for k in range(3)]
    tally = Tally(args.records)
    out: dict[str, Any] = {}
    try:
        with BatchStream([p.endpoint for p in producers], exact=True, recv_timeout=120, queue_capacity=8,
                         stall_after=args.stall_after) as stream:
            _rate(stream, tally, args.warmup)
            out["images_per_s_three"] = _rate(stream, tally, args.seconds)
            last_open = _completed(stream) + 1  # the epochs open at the freeze: it may hold records of either
            producers[0].pause()
            frozen = time.monotonic()
            while _completed(stream) <= last_open or "freeze_to_stuck_s" not in out:
                if time.monotonic() - frozen > 300:
                    raise RuntimeError(f"epoch {last_open} never completed after the freeze: {stream.stats}")
                if "freeze_to_stuck_s" not in out and stream.stats.producers_stuck:
                    out["freeze_to_stuck_s"] = time.monotonic() - frozen
                if "freeze_to_epoch_complete_s" not in out and _completed(stream) > last_open:
                    out["freeze_to_epoch_complete_s"] = time.monotonic() - frozen
                tally.take(stream)
            out.setdefault("freeze_to_epoch_complete_s", time.monotonic() - frozen)
            out["stall_bound_s"] = _scheduler(stream).pace.stall_bound()
            out["images_per_s_two_left"] = _rate(stream, tally, args.seconds)
            stats = stream.stats
            out.update(splits_reserved=stats.splits_reserved, wasted_records=stats.wasted_records,
                       producers_stuck=stats.producers_stuck)
            out.update(tally.check(_completed(stream)))
    finally:
        for p in producers:
            p.stop()
    return out


def _epoch_seconds(lmdb: Path, args: argparse.Namespace, slow: bool, epochs: int) -> dict[str, Any]:
    names = ["h0", "h1", *(["slow"] if slow else [])]
    producers = [launch_producer(lmdb, _pool_flags(args, n, epochs + 1)) for n in names]
    tally = Tally(args.records)
    try:
        throttle = Throttle(producers[-1], slowdown=4.0) if slow else None
        with BatchStream([p.endpoint for p in producers], exact=True, recv_timeout=120, queue_capacity=8,
                         stall_after=args.stall_after) as stream:
            tally.take(stream)  # epoch 0 is the warm-up: processes start, caches fill
            if throttle is not None:
                throttle.__enter__()
            try:
                while _completed(stream) < 1:
                    tally.take(stream)
                t0 = time.monotonic()
                while _completed(stream) < 1 + epochs:
                    tally.take(stream)
                seconds = (time.monotonic() - t0) / epochs
            finally:
                if throttle is not None:
                    throttle.__exit__()
            for _ in stream:
                pass  # the last epoch's rest
            stats = stream.stats
            return {"epoch_s": seconds, "backups": stats.splits_backed_up, "wasted_records": stats.wasted_records,
                    "splits_reserved": stats.splits_reserved, **tally.check(_completed(stream))}
    finally:
        for p in producers:
            p.stop()


def straggler(lmdb: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Epoch time, two healthy producers plus one at a quarter speed vs the two alone, interleaved rounds; and the
    same straggler with backups off (an ablation: the scheduler runs in this process, its factor is patched)."""
    from stoker.consumer.exact.pool import split_scheduler

    def configured(name: str) -> dict[str, Any]:
        factor = split_scheduler.BACKUP_FACTOR
        if name == "no_backups":
            split_scheduler.BACKUP_FACTOR = float("inf")
        try:
            return _epoch_seconds(lmdb, args, name != "healthy", args.straggler_epochs)
        finally:
            split_scheduler.BACKUP_FACTOR = factor

    rounds = []
    names = ["healthy", "with_straggler", "no_backups"]
    for r in range(args.rounds):
        got = {name: configured(name) for name in names[r % 3:] + names[:r % 3]}  # the order rotates
        rounds.append({**got, "ratio": got["with_straggler"]["epoch_s"] / got["healthy"]["epoch_s"],
                       "ratio_no_backups": got["no_backups"]["epoch_s"] / got["healthy"]["epoch_s"]})

    def spread(key: str) -> tuple[float, float, float]:
        values = sorted(r[key] for r in rounds)
        return values[len(values) // 2], values[0], values[-1]

    (median, low, high), (median_off, low_off, high_off) = spread("ratio"), spread("ratio_no_backups")
    return {"rounds": rounds, "ratio_median": median, "ratio_min": low, "ratio_max": high,
            "no_backups_median": median_off, "no_backups_min": low_off, "no_backups_max": high_off}


def scheduler_at_scale(records: int, batch: int, producers: int, batches: int) -> dict[str, Any]:
    """The trainer's scheduling work per batch on a large pool, without images (a million-image LMDB takes hours to
    build here): ``producers`` serve in turn, a newcomer joins halfway; CPU microseconds per batch for what the
    transport does on each (arrived, consumed, a top-up of every producer fewest first, a stall check every 0.25 s)
    and how many work items the newcomer got at its first top-up."""
    from stoker.consumer.exact.ledger import ConsumedLedger
    from stoker.consumer.exact.pool.split_plan import split_records
    from stoker.consumer.exact.pool.split_scheduler import SplitScheduler
    from stoker.protocol.input_state import InputState, StreamKey

    key = StreamKey.parse(f"splits:{records}:0")
    state = InputState()
    ledger = ConsumedLedger("bench", state)  # writes the epochs the scheduler completes, as in a trainer
    sched = SplitScheduler(key, ledger.pool_progress(str(key)), partial(ledger.complete_pool_epoch, str(key)), None,
                           split_records(records, batch))
    held: dict[int, list] = {p: [] for p in range(producers)}
    now, newcomer_items = 0.0, None
    checked = 0.0
    start = time.process_time()  # the whole loop: the simulated producers' bookkeeping too (an upper bound)
    for n in range(batches):
        if n == batches // 2:
            items = sched.top_up(producers, now)
            held[producers] = [[i.epoch, sched.open[i.epoch].order[i.start:i.end]] for i in items]
            newcomer_items = len(items)
        p = n % len(held)
        for q in ([p] if not sched.holding(p) else []) + sched.wants_work():  # as the transport does
            for item in sched.top_up(q, now):
                order = sched.open[item.epoch].order[item.start:item.end]
                held[q].append([item.epoch, order])
        if held[p]:
            epoch, order = held[p][0]
            take, held[p][0][1] = order[:batch], order[batch:]
            if not len(held[p][0][1]):
                held[p].pop(0)
            epochs = np.full(len(take), epoch)
            keep = sched.arrived(epochs, take, np.ones(len(take), bool), p, now)
            state.progress(str(key)).mark(epoch, take[keep])
            sched.consumed(epochs[keep], take[keep])
        if now - checked >= 0.25:
            checked = now
            sched.stalls(now)
        now += 0.01
    t_cpu = time.process_time() - start
    return {"records": records, "batch": batch, "producers": producers, "batches": batches,
            "split_records": sched.split, "cpu_us_per_batch": 1e6 * t_cpu / batches,
            "newcomer_items_at_first_top_up": newcomer_items, "wasted_records": sched.duplicates,
            "producers_stuck": sched.stalls_seen}


def liveness(tmp: Path, lmdb: Path, args: argparse.Namespace) -> dict[str, Any]:
    demo = tmp / "demo"
    build_synthetic(demo, 1024, seed=0, progress=False)
    out: dict[str, Any] = {"joining": [joining(demo, 1024, args)]}
    if args.large_records:
        large = tmp / "large"
        build_synthetic(large, args.large_records, seed=0, progress=False)
        out["joining"].append(joining(large, args.large_records, args))
    out["scheduler_at_scale"] = [scheduler_at_scale(n, 64, p, 4000) for n, p in ((1_000_000, 16), (1_000_000, 100))]
    out["stuck"] = stuck(lmdb, args)
    out["straggler"] = straggler(lmdb, args)
    return out


def print_liveness(live: dict[str, Any]) -> None:
    print("\nLiveness (issue 29)")
    for j in live["joining"]:
        print(f"joining, {j['records']:,} records: first batch {j['join_to_first_batch_s']:.2f} s after joining; images/s "
              f"{j['images_per_s_two']:.0f} (2) -> {j['images_per_s_three']:.0f} (3), step {j['step']:.2f}x "
              f"({j['producer_cores'][0]:.2f} -> {j['producer_cores'][1]:.2f} producer cores: {j['vs_linear']:.2f} of linear); batches {j['batches_per_producer']}; wasted records "
              f"{j['wasted_records']}; twice {j['twice']}, never {j['never']}")
    for k in live["scheduler_at_scale"]:
        print(f"scheduler, {k['records']:,} records in splits of {k['split_records']}, {k['producers']} producers: "
              f"{k['cpu_us_per_batch']:.0f} us CPU per batch of {k['batch']}; a newcomer got "
              f"{k['newcomer_items_at_first_top_up']} split(s) at its first top-up; wasted {k['wasted_records']}, "
              f"stuck {k['producers_stuck']}")
    s = live["stuck"]
    print(f"stuck: taken for stuck {s.get('freeze_to_stuck_s', float('nan')):.1f} s after the freeze, the epochs open "
          f"at the freeze complete {s['freeze_to_epoch_complete_s']:.1f} s after it (stall bound "
          f"{s['stall_bound_s']:.1f} s); images/s {s['images_per_s_three']:.0f} (3) -> {s['images_per_s_two_left']:.0f} "
          f"(2 left); splits re-served {s['splits_reserved']}, records wasted {s['wasted_records']}; twice "
          f"{s['twice']}, never {s['never']}")
    g = live["straggler"]
    for k, r in enumerate(g["rounds"]):
        runs = [r["healthy"], r["with_straggler"], r["no_backups"]]
        print(f"straggler round {k}: epoch {r['healthy']['epoch_s']:.2f} s with 2 healthy, "
              f"{r['with_straggler']['epoch_s']:.2f} s with a quarter-speed third ({r['ratio']:.2f}x; backups "
              f"{r['with_straggler']['backups']}, wasted {r['with_straggler']['wasted_records']}), "
              f"{r['no_backups']['epoch_s']:.2f} s with backups off ({r['ratio_no_backups']:.2f}x); healthy wasted "
              f"{r['healthy']['wasted_records']}; twice {sum(x['twice'] for x in runs)}, "
              f"never {sum(x['never'] for x in runs)}")
    print(f"straggler: median {g['ratio_median']:.2f}x (range {g['ratio_min']:.2f}-{g['ratio_max']:.2f}); backups off "
          f"{g['no_backups_median']:.2f}x ({g['no_backups_min']:.2f}-{g['no_backups_max']:.2f})")


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--producers", type=int, default=3, help="producers added one at a time (>= 3)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds after a change before measuring")
    parser.add_argument("--records", type=int, default=3000, help="records in the synthetic dataset")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=160, help="crop size in pixels")
    add_out_argument(parser, "elastic.json")
    parser.add_argument("--liveness-only", action="store_true", help="only the joining, stuck and straggler phases")
    parser.add_argument("--large-records", type=int, default=0,
                        help="also time a join on a dataset this large (0: only the 1,024-record one)")
    parser.add_argument("--stall-after", type=float, default=3.0, help="the trainers' stall bound floor, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the straggler phase")
    parser.add_argument("--straggler-epochs", type=int, default=2, help="epochs timed per straggler round")
    args = parser.parse_args()
    if args.producers < 3:
        parser.error("--producers must be at least 3 (the run SIGKILLs one and scales one down)")
    return args


def grow_and_shrink(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """The pool phases: producers added one at a time, then p2 SIGKILLed and p3 scaled down; each phase measured,
    each newcomer's time to its first batch, and what the trainer's split bookkeeping counted."""
    phases: list[dict[str, Any]] = []
    joins: list[dict[str, Any]] = []
    try:
        first, first_started = run.start_producer("p1")
        run.pool.append(first.endpoint)
        first_joined = time.monotonic()
        with BatchStream(lambda: list(run.pool), exact=True, recv_timeout=120, discover_every=0.2,
                         queue_capacity=8) as stream:
            run.stream = stream
            for k in range(1, args.producers + 1):
                name = f"p{k}"
                if k == 1:
                    producer, started, joined = first, first_started, first_joined
                    run.take_one()  # the stream starts with its first next()
                else:
                    producer, started = run.start_producer(name)
                    joined = time.monotonic()
                    run.pool.append(producer.endpoint)
                run.take_until(lambda: stream.stats.per_producer.get(name, 0) > 0)
                first = time.monotonic()
                joins.append({"producer": name, "start_to_first_batch_s": first - started,
                              "join_to_first_batch_s": first - joined})
                phases.append(run.measure(f"+{name}"))
            # Shrinking: one SIGKILLed (still in the pool, as DNS lags a dead pod), then one scaled down.
            victim = run.producers["p2"]
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            run.pool.remove(victim.endpoint)
            phases.append(run.measure("p2 SIGKILLed"))
            leaving = run.producers["p3"]
            run.pool.remove(leaving.endpoint)
            time.sleep(0.3)
            leaving.stop()
            phases.append(run.measure("p3 scaled down"))
            splits = _scheduler(stream)
            return {"phases": phases, "joins": joins, "dropped": splits.duplicates, "released": splits.released,
                    "completed": splits.progress.completed}
    finally:
        for producer in run.producers.values():
            producer.stop()


def pool_result(run: Run, pool: dict[str, Any], args: argparse.Namespace, plain: dict[str, Any],
                live: dict[str, Any]) -> dict[str, Any]:
    """The JSON of a full run: each phase against the first (and against linear), each epoch's coverage."""
    phases, completed = pool["phases"], pool["completed"]
    base = phases[0]
    for phase in phases:
        ratio = phase["images_per_s"] / base["images_per_s"]
        cores = phase["producer_cores"] / base["producer_cores"]
        phase["vs_one_producer"] = ratio
        phase["linear"] = ratio / cores if cores else 0.0
    epochs = []
    for epoch in sorted(run.seen):
        counts = run.seen[epoch]
        epochs.append({"epoch": epoch, "seen": len(counts), "twice": sum(1 for n in counts.values() if n > 1),
                       "never": args.records - len(counts) if epoch < completed else None})
    return {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "args": vars(args), "phases": phases, "joins": pool["joins"], "epochs": epochs,
            "epochs_completed": completed, "rows_dropped_as_arrived_before": pool["dropped"],
            "splits_released": pool["released"],
            "twice_total": sum(e["twice"] for e in epochs),
            "never_total": sum(e["never"] or 0 for e in epochs), "plain": plain, "liveness": live}


def print_pool(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nElastic pool, {args.records} records, batches of {args.batch} x {args.size} px, one worker per producer, "
          f"{os.cpu_count()} CPUs")
    print(f"{'phase':<16}{'producers':>10}{'images/s':>10}{'vs 1':>7}{'prod cores':>11}{'linear':>8}"
          f"{'consumer cores':>16}")
    for p in result["phases"]:
        print(f"{p['phase']:<16}{p['producers']:>10}{p['images_per_s']:>10.0f}{p['vs_one_producer']:>7.2f}"
              f"{p['producer_cores']:>11.2f}{p['linear']:>8.2f}{p['consumer_cores']:>16.2f}")
    for j in result["joins"]:
        print(f"{j['producer']}: first batch {j['start_to_first_batch_s']:.2f} s after its process started, "
              f"{j['join_to_first_batch_s']:.2f} s after it joined the pool")
    print(f"epochs: {result['epochs_completed']} completed; records seen twice: {result['twice_total']}, never "
          f"(completed epochs): {result['never_total']}; rows dropped at the trainer as arrived before: "
          f"{result['rows_dropped_as_arrived_before']}; splits taken back from producers that left: "
          f"{result['splits_released']}")
    plain = result["plain"]
    print(f"plain mode (fixed shards 0/2, 1/2): the second producer's first batch {plain['start_to_first_batch_s']:.2f} s "
          f"after its start ({plain['join_to_first_batch_s']:.2f} s after joining); images/s "
          f"{plain['images_per_s_one']:.0f} -> {plain['images_per_s_two']:.0f}, "
          f"{plain['images_per_s_after_leave']:.0f} after the first left; records received per shard and epoch: "
          + coverage_text({(shard, int(e)): (s, r) for shard, epochs in plain["coverage"].items()
                           for e, (s, r) in epochs.items()}))


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stoker-elastic-"))
    build_synthetic(tmp / "data", args.records, seed=0, progress=False)
    if args.liveness_only:
        live = liveness(tmp, tmp / "data", args)
        print_liveness(live)
        write_results(args.out, {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                                 "args": vars(args), "liveness": live})
        return
    run = Run(tmp / "data", args)
    pool = grow_and_shrink(run, args)
    plain = plain_join(tmp / "data", args)
    live = liveness(tmp, tmp / "data", args)
    result = pool_result(run, pool, args, plain, live)
    print_pool(result, args)
    print_liveness(live)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
