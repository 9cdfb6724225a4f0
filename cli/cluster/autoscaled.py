"""``stoker cluster --autoscale``: an elastic pool on simulated hosts whose size follows the trainers' need.

The cluster has ``max_producers`` data hosts; ``min_producers`` of them serve from the start. The trainers run
``stoker train --metrics-port METRICS_PORT`` in their namespaces, and this namespace joins the switch (the
operator link) to read them, unless ``--autoscale-metrics`` names other URLs. ``AutoscaleLoop`` runs from the
trainers' wait loop (``run.run_prefixed``'s tick, every 0.2 s): every ``interval_s`` one ``Autoscaler.step`` (scrape,
sum, one ``SizingPolicy``), then ``ScaledPool.resize``; each decision that moves the pool, and the first, is logged
with the policy's inputs, and the status line every ``STATUS_EVERY_S`` says the pool's size and the last decision.
Everything stops with the trainers, or on Ctrl-C or SIGTERM (made a KeyboardInterrupt here) through ``run.py``'s teardown: no step waits longer than
one scrape's timeout per trainer. Only the first signal interrupts: one more during the teardown is said and ignored
(``InterruptOnce``), so the producers are always stopped and the namespaces deleted.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from stoker.cli.cluster.autoscale import (DEFAULT_INTERVAL_S, DEFAULT_STALE_AFTER_S, DEFAULT_TIMEOUT_S, Autoscaler,
                                          Decision, TrainerScraper, check_metrics_url)
from stoker.cli.cluster.elastic import POOL_NAME, ConsumedWatcher, PoolNames
from stoker.cli.cluster.local_cluster import LocalCluster
from stoker.cli.cluster.run import PORT, ClusterRun, producer_lines, run_prefixed, start_producer
from stoker.cli.cluster.scaled_pool import DEFAULT_DRAIN_S, ScaledPool
from stoker.cli.command_lines import train_command
from stoker.consumer.sizing.policy import SizingPolicy
from stoker.producer.dataset.sources import LmdbDataset

#: The port each trainer serves its metrics on, inside its own namespace.
METRICS_PORT = 9400


@dataclass(frozen=True)
class AutoscaleOptions:
    """The ``--autoscale`` flags. ``metrics``: trainer metrics URLs (empty: the cluster's own trainers')."""

    metrics: tuple[str, ...] = ()
    min_producers: int = 1
    max_producers: int = 8
    interval_s: float = DEFAULT_INTERVAL_S
    down_hold_s: float = 60.0
    drain_s: float = DEFAULT_DRAIN_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    stale_after_s: float = DEFAULT_STALE_AFTER_S

    def __post_init__(self) -> None:
        if not 1 <= self.min_producers <= self.max_producers <= 64:
            raise ValueError(f"autoscale needs 1 <= --min-producers <= --max-producers <= 64, got "
                             f"{self.min_producers} and {self.max_producers}")
        if self.interval_s <= 0 or self.down_hold_s < 0 or self.drain_s < 0 or self.timeout_s <= 0:
            raise ValueError("--autoscale-interval and the scrape timeout must be > 0, the down hold and drain >= 0")
        for url in self.metrics:
            check_metrics_url(url)  # before any host is made: file:// and the like are refused, named

    def policy(self, clock: Callable[[], float] = time.monotonic) -> SizingPolicy:
        return SizingPolicy(down_hold_s=self.down_hold_s, min_producers=self.min_producers,
                            max_producers=self.max_producers, clock=clock)


class AutoscaleLoop:
    """One ``Autoscaler`` acting on one ``ScaledPool``; ``tick`` as often as convenient, it acts when due."""

    STATUS_EVERY_S = 5.0
    #: Decisions kept in ``decisions``: a long run's record stays bounded (``decisions_logged`` counts them all).
    KEEP_DECISIONS = 1000

    def __init__(self, autoscaler: Autoscaler, pool: ScaledPool, interval_s: float,
                 clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] = print,
                 keep_decisions: int = KEEP_DECISIONS) -> None:
        self.autoscaler, self.pool, self.interval_s, self._clock, self._log = autoscaler, pool, interval_s, clock, log
        #: The latest decisions that moved the pool (and the first), oldest first: the run's record.
        self.decisions: deque[Decision] = deque(maxlen=keep_decisions)
        self.decisions_logged = 0
        self._next = self._status_at = clock()

    def tick(self) -> Optional[Decision]:
        """Stop drained producers; if due, decide and resize. The decision made now, if any."""
        self.pool.tick()
        now = self._clock()
        decision = None
        if now >= self._next:
            self._next = now + self.interval_s
            decision = self.autoscaler.step(self.pool.size)
            if decision.target != decision.current or not self.decisions_logged:
                self._log(decision.line())
                self.decisions.append(decision)
                self.decisions_logged += 1
            self.pool.resize(decision.target)
        if now >= self._status_at:
            self._status_at = now + self.STATUS_EVERY_S
            self._log(self.status())
        return decision

    def status(self) -> str:
        last = self.autoscaler.last
        said = last.line().removeprefix("autoscale: ") if last is not None else "no decision yet"
        return (f"cluster: {self.pool.size} data host(s) in the pool, {self.pool.draining()} draining; "
                f"last decision: {said}")


class InterruptOnce:
    """The SIGTERM and SIGINT handler of a run: the first signal raises KeyboardInterrupt (the run stops at once,
    through its teardown); one more, or any once ``tearing_down`` is set (a run ending on its own), is written to
    stderr and ignored, so a second signal cannot cut the teardown short and leave namespaces behind."""

    def __init__(self) -> None:
        self.tearing_down = False

    def __call__(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.tearing_down:
            # os.write, not print: a handler that prints can land inside a print (a reentrant-call error).
            try:
                os.write(sys.stderr.fileno(), f"stoker cluster: {name} during the teardown: ignored; stopping the "
                                              "producers and deleting the namespaces first\n".encode())
            except (OSError, ValueError):
                pass
            return
        self.tearing_down = True
        raise KeyboardInterrupt(name)


@contextmanager
def interrupt_once() -> Iterator[InterruptOnce]:
    """``InterruptOnce`` on SIGTERM and SIGINT for the block, the previous handlers restored after it; main thread."""
    guard = InterruptOnce()
    previous = {signum: signal.signal(signum, guard) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield guard
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_autoscaled(run: ClusterRun, options: AutoscaleOptions) -> int:
    """``run_cluster`` with the pool under ``AutoscaleLoop``; the worst trainer exit code. SIGTERM, as Ctrl-C,
    ends the run through the teardown (trainers, producers, namespaces), which no further signal interrupts; the
    signals are handled from the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return _run_autoscaled(run, options, InterruptOnce())  # no handler here: the flag is only written
    with interrupt_once() as guard:
        return _run_autoscaled(run, options, guard)


def _run_autoscaled(run: ClusterRun, options: AutoscaleOptions, guard: InterruptOnce) -> int:
    with LmdbDataset(run.lmdb_path) as dataset:
        classes, records = len(dataset.meta.classes), dataset.meta.count
    with LocalCluster(options.max_producers, rate=run.rate, trainers=run.trainers,
                      operator=not options.metrics) as cluster:
        names = PoolNames([t.namespace for t in cluster.trainers if t.namespace])
        pool = ScaledPool([h.address for h in cluster.hosts], lambda i: start_producer(run, cluster, i),
                          names.set, drain_s=options.drain_s)
        log_dir = Path(run.log_consumed or tempfile.mkdtemp(prefix="stoker-cluster-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        started: Optional[float] = None
        try:
            pool.resize(options.min_producers)
            urls = list(options.metrics) or [f"http://{t.address}:{METRICS_PORT}/metrics" for t in cluster.trainers]
            print(f"autoscale: pool of {options.min_producers}-{options.max_producers} data hosts, trainers connect "
                  f"to tcp://{POOL_NAME}:{PORT}; reading {', '.join(urls)} every {options.interval_s:g} s, down after "
                  f"{options.down_hold_s:g} s below", flush=True)
            commands = [trainer.command(train_command(
                f"tcp://{POOL_NAME}:{PORT}", model=run.model, steps=run.steps, batch_size=run.batch_size,
                image_size=run.image_size, classes=classes, queue_capacity=run.queue_capacity, exact=True,
                trainer_id=trainer.name, discover_every=1.0, share=(j, run.trainers),
                log_consumed=log_dir / f"{trainer.name}.jsonl", no_progress=True) + ["--metrics-port",
                                                                                     str(METRICS_PORT)])
                for j, trainer in enumerate(cluster.trainers)]
            autoscaler = Autoscaler(TrainerScraper(urls, options.timeout_s, options.stale_after_s), options.policy())
            loop = AutoscaleLoop(autoscaler, pool, options.interval_s)
            watcher = ConsumedWatcher([log_dir / f"{t.name}.jsonl" for t in cluster.trainers])
            started = time.monotonic()
            code = run_prefixed(commands, [t.name for t in cluster.trainers], tick=loop.tick)
            watcher.print_coverage(records)
            return code
        finally:
            guard.tearing_down = True  # from here to LocalCluster's exit, a signal is said and ignored
            ended = time.monotonic()
            pool.close()
            if started is not None:
                print("producers (each daemon's own count at its stop):", flush=True)
                for line in producer_lines(pool.producers, started, ended):
                    print(f"  {line}", flush=True)
            names.close()
            if not run.log_consumed:
                shutil.rmtree(log_dir, ignore_errors=True)
