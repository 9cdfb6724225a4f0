#!/usr/bin/env python3
"""``stoker cluster --autoscale``'s controller against a fixed pool sized for the peak, side by side (issue 43).

Two runs at once, each a trainer of fixed step time (a ``BatchStream`` loop, exact mode, sleeping a fixed step per
batch) following an elastic pool of producers throttled to a fixed supply (``fixed_supply_pipeline.py``: each sample
sleeps ``--sample-s``, so producers add supply, not CPU, on 2 cores):

- *autoscaled*: data hosts of a ``LocalCluster`` (network namespaces, root) added and removed by the same
  ``Autoscaler`` + ``ScaledPool`` + ``AutoscaleLoop`` as ``stoker cluster --autoscale`` (this process reads the
  trainer's metrics endpoint, sums ``stoker_trainer_producers_needed``, rounds once; down after ``--down-hold``,
  newest first, drained);
- *fixed*: ``--peak`` producers on loopback for the whole run.

Phase 1: demand about ``--peak-demand`` producers' supply (ideal pool: ceil(demand x 1.15 headroom)); phase 2: about
``--low-demand``. Reported: seconds to converge to the ideal +-1 after each change (goal <= 60 s), pool changes over
the steady hold (goal 0), seconds each trainer waited for input, producer-seconds, and records twice / never
(complete epochs; goal 0 / 0). Prints a table and writes JSON (default benchmarks/results/autoscale.json).
Run (root):  python benchmarks/autoscale.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

from harness import add_out_argument, benchmark_parser, machine_info, synthetic_lmdb, write_results
from stoker.cli.cluster.autoscale import Autoscaler, TrainerScraper
from stoker.cli.cluster.autoscaled import AutoscaleLoop
from stoker.cli.cluster.local_cluster import LocalCluster
from stoker.cli.cluster.scaled_pool import ScaledPool
from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.sizing.policy import SizingPolicy
from stoker.producer.process import ProducerProcess
from stoker.producer.produce_command import produce_flags

PIPELINE = str(Path(__file__).with_name("fixed_supply_pipeline.py")) + ":make_pipeline"
PORT = 5555


class Trainer:
    """A fixed-step trainer on its own thread: per phase (seconds, step seconds); waits and records counted."""

    def __init__(self, name: str, addresses: Callable[[], list[str]], batch_size: int) -> None:
        self.name, self.addresses, self.batch_size = name, addresses, batch_size
        self.seen: dict[int, Counter] = defaultdict(Counter)
        self.waited_s = 0.0
        self.rows = 0
        self.stop = threading.Event()
        self.step_s = 1.0
        self.metrics_port = 0
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            with BatchStream(lambda: self.addresses(), exact=True, recv_timeout=120, discover_every=0.5,
                             queue_capacity=8) as stream:
                self.metrics_port = stream.serve_metrics(0, "127.0.0.1")
                self.ready.set()
                while not self.stop.is_set():
                    asked = time.monotonic()
                    batch = next(stream)
                    self.waited_s += time.monotonic() - asked if self.rows else 0.0  # the first batch: start-up
                    for e, i in zip(batch["epoch"].tolist(), batch["index"].tolist()):
                        self.seen[e][i] += 1
                    self.rows += len(batch["index"])
                    time.sleep(self.step_s)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            self.error = exc
            self.ready.set()

    def exactness(self, records: int) -> dict[str, int]:
        """Records twice (every epoch) and never (every epoch but the last two, which may be open at the stop)."""
        epochs = sorted(self.seen)
        complete = epochs[:-2]
        return {"twice": sum(sum(1 for n in c.values() if n > 1) for c in self.seen.values()),
                "never": sum(records - len(self.seen[e]) for e in complete), "complete_epochs": len(complete)}


def converge_s(sizes: list[tuple[float, int]], start: float, end: float, ideal: int) -> float | None:
    """Seconds from ``start`` until the pool size entered ideal +-1 for good (until ``end``); None: never did."""
    inside_since: float | None = start
    for t, size in sizes:
        if t > end:
            break
        if abs(size - ideal) > 1:
            inside_since = None
        elif inside_since is None:
            inside_since = max(t, start)
    return None if inside_since is None else inside_since - start


def arguments() -> argparse.Namespace:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short phases (smoke run)")
    parser.add_argument("--sample-s", type=float, default=0.01, help="each producer's seconds per sample")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--peak-demand", type=float, default=2.3, help="phase 1 demand, in producers' supply")
    parser.add_argument("--low-demand", type=float, default=0.6, help="phase 2 demand, in producers' supply")
    parser.add_argument("--hold", type=float, default=300, help="steady seconds of phase 1 after the first 60")
    parser.add_argument("--low-seconds", type=float, default=150, help="phase 2's length")
    parser.add_argument("--down-hold", type=float, default=30, help="the policy's down hold")
    parser.add_argument("--interval", type=float, default=5, help="seconds between decisions")
    parser.add_argument("--max-producers", type=int, default=5)
    add_out_argument(parser, "autoscale.json")
    args = parser.parse_args()
    if args.quick:
        args.hold, args.low_seconds, args.down_hold = 20, 60, 10
    return args


class Bench:
    """Both runs side by side: the autoscaled pool on a LocalCluster, the fixed pool on loopback."""

    def __init__(self, args: argparse.Namespace, lmdb: Path, cluster: LocalCluster) -> None:
        self.args, self.supply = args, 1 / args.sample_s  # images/s per producer
        self.t0, self.log = time.monotonic(), []
        # the fixed pool is sized for the peak as a user would: demand x the same headroom, nominal supply
        self.peak = math.ceil(args.peak_demand * 1.15 - 1e-9)
        # the ideal pool: the fewest producers whose supply meets the demand
        self.phases = [("peak", args.peak_demand, 60 + args.hold, math.ceil(args.peak_demand - 1e-9)),
                       ("low", args.low_demand, args.low_seconds, math.ceil(args.low_demand - 1e-9))]
        flags = produce_flags(workers=1, batch_size=args.batch_size, shard="auto") + [
            "--pipeline", PIPELINE, "--pipeline-arg", f"sample_s={args.sample_s}"]
        self.published: tuple[str, ...] = ()
        self.pool = ScaledPool([h.address for h in cluster.hosts],
                               lambda i: ProducerProcess(lmdb, bind=f"tcp://{cluster.hosts[i].address}:{PORT}",
                                                         extra_args=flags + ["--id", f"{cluster.hosts[i].name}#auto"],
                                                         command_prefix=cluster.hosts[i].command([])),
                               self._publish, log=self.say)
        self.fixed = [ProducerProcess(lmdb, bind="tcp://127.0.0.1:*", extra_args=flags + ["--id", f"fixed{k}#auto"])
                      for k in range(self.peak)]
        self.auto = Trainer("autoscaled", lambda: list(self.published), args.batch_size)
        self.still = Trainer("fixed", lambda: [p.endpoint for p in self.fixed], args.batch_size)
        self.sizes: list[tuple[float, int]] = []
        self.producer_s = {"autoscaled": 0.0, "fixed": 0.0}
        self.marks: list[tuple] = []
        self.loop: AutoscaleLoop | None = None

    def _publish(self, addresses: list[str]) -> None:
        self.published = tuple(f"tcp://{a}:{PORT}" for a in addresses)

    def say(self, line: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:7.1f} {line}")
        print(self.log[-1], flush=True)

    def run(self) -> None:
        self.pool.resize(1)
        for trainer in (self.auto, self.still):
            trainer.step_s = self.args.batch_size / (self.phases[0][1] * self.supply)
            trainer.thread.start()
            trainer.ready.wait(60)
        scaler = Autoscaler(TrainerScraper([f"http://127.0.0.1:{self.auto.metrics_port}/metrics"], log=self.say),
                            SizingPolicy(down_hold_s=self.args.down_hold, max_producers=self.args.max_producers))
        self.loop = AutoscaleLoop(scaler, self.pool, self.args.interval, log=self.say)
        self.sizes.append((time.monotonic(), self.pool.size))
        last = time.monotonic()
        for name, demand, seconds, ideal in self.phases:
            start = time.monotonic()
            for trainer in (self.auto, self.still):
                trainer.step_s = self.args.batch_size / (demand * self.supply)
            waited0 = (self.auto.waited_s, self.still.waited_s)
            self.say(f"phase {name}: demand {demand * self.supply:.0f} images/s ({demand} producers' supply), "
                     f"ideal {ideal} producers")
            while time.monotonic() - start < seconds:
                for trainer in (self.auto, self.still):
                    if trainer.error is not None:
                        raise RuntimeError(f"{trainer.name} trainer failed: {trainer.error!r}")
                self.loop.tick()
                now = time.monotonic()
                self.producer_s["autoscaled"] += (self.pool.size + self.pool.draining()) * (now - last)
                self.producer_s["fixed"] += len(self.fixed) * (now - last)
                last = now
                if self.pool.size != self.sizes[-1][1]:
                    self.sizes.append((now, self.pool.size))
                time.sleep(0.2)
            self.marks.append((name, start, time.monotonic(), ideal, self.auto.waited_s - waited0[0],
                               self.still.waited_s - waited0[1]))

    def close(self) -> None:
        for trainer in (self.auto, self.still):
            trainer.stop.set()
        for trainer in (self.auto, self.still):
            trainer.thread.join(30)
        self.pool.close()
        for producer in self.fixed:
            producer.stop()

    def result(self) -> dict[str, Any]:
        report = []
        for name, start, end, ideal, waited_auto, waited_fixed in self.marks:
            changes = [s for t, s in self.sizes if start + 60 <= t <= end] if name == "peak" else []
            report.append({"phase": name, "ideal": ideal, "seconds": end - start,
                           "converge_s": converge_s(self.sizes, start, end, ideal),
                           "changes_in_steady_hold": len(changes), "steady_hold_s": max(0.0, end - start - 60),
                           "waited_s": {"autoscaled": waited_auto, "fixed": waited_fixed}})
        records = self.args.records
        return {"machine": machine_info(), "args": vars(self.args), "supply_per_producer": self.supply,
                "fixed_pool": self.peak, "phases": report, "sizes": [(t - self.t0, s) for t, s in self.sizes],
                "producer_seconds": self.producer_s,
                "waited_s": {"autoscaled": self.auto.waited_s, "fixed": self.still.waited_s},
                "images": {"autoscaled": self.auto.rows, "fixed": self.still.rows},
                "exactness": {"autoscaled": self.auto.exactness(records), "fixed": self.still.exactness(records)},
                "decisions": [d.line() for d in self.loop.decisions] if self.loop else [], "log": self.log}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'phase':<6} {'ideal':>5} {'converged in':>13} {'changes in hold':>16} {'waited auto':>12} "
          f"{'waited fixed':>13}")
    for r in result["phases"]:
        conv = "never" if r["converge_s"] is None else f"{r['converge_s']:.0f} s"
        print(f"{r['phase']:<6} {r['ideal']:>5} {conv:>13} {r['changes_in_steady_hold']:>16} "
              f"{r['waited_s']['autoscaled']:>10.1f} s {r['waited_s']['fixed']:>11.1f} s")
    ps, images = result["producer_seconds"], result["images"]
    print(f"producer-seconds: autoscaled {ps['autoscaled']:.0f}, fixed pool of {result['fixed_pool']} "
          f"{ps['fixed']:.0f}; images {images['autoscaled']} / {images['fixed']}; exactness {result['exactness']}")


def main() -> None:
    args = arguments()
    with synthetic_lmdb(args.records, "autoscale") as lmdb, \
            LocalCluster(args.max_producers, trainer_namespace=False) as cluster:
        bench = Bench(args, lmdb, cluster)
        try:
            bench.run()
        finally:
            bench.close()
        result = bench.result()
    print_table(result)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
