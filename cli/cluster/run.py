"""``stoker cluster``: producers on separate simulated hosts feeding trainers on others, on this machine.

Builds a LocalCluster (one network namespace per data host and per trainer host,
joined by a switch; data links optionally shaped with tc tbf), starts ``stoker
produce`` in every data host's namespace on its own address with a disjoint
shard, then runs ``stoker train`` in each trainer host's namespace pointed at all
of them. With ``epochs`` the producers run exact, finite epochs and wait until
every trainer joined; each trainer trains until the epochs end and can log what
it consumed, so coverage across trainers can be checked. With ``add_host_at``/
``remove_host_at`` the producers form an elastic pool (``--shard auto``) that trainers find by
name (``elastic.py``): a data host joins and one leaves mid-run, and the harness prints
images/s over time and the epochs' coverage (one line for those every record of which came once, one
per other epoch). Everything is torn down when training ends, fails, or is interrupted: producers
are stopped, any process left in the namespaces is killed, the namespaces deleted. Last, one line per producer
(``producer_lines``): its id, batches, images and images/s, a producer that sent nothing included.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from stoker.producer.dataset.sources import LmdbDataset
from stoker.producer.process import ProducerProcess

from stoker.cli.cluster.elastic import POOL_NAME, ConsumedWatcher, PoolNames
from stoker.cli.cluster.local_cluster import ClusterError, LocalCluster, check_available
from stoker.cli.command_lines import produce_flags, train_command

if TYPE_CHECKING:
    from stoker.cli.cluster.autoscaled import AutoscaleOptions

PORT = 5555


@dataclass(frozen=True)
class ClusterRun:
    """What ``stoker cluster`` runs (its flags)."""

    lmdb_path: str
    hosts: int = 2
    rate: Optional[str] = None
    workers: int = 1
    batch_size: int = 64
    image_size: int = 224
    model: str = "small-cnn"
    steps: int = 200
    queue_capacity: int = 50
    seed: int = 0
    no_progress: bool = False  # the trainers log lines instead of a progress bar (always, with several trainers)
    trainers: int = 1
    epochs: Optional[int] = None  # exact, finite: the producers stop after these epochs, the trainers with them
    mode: str = "train"
    log_consumed: Optional[str] = None  # folder: trainer<j>.jsonl per trainer (each step's records)
    add_host_at: Optional[float] = None  # elastic pool: a data host joins this many seconds into training
    remove_host_at: Optional[float] = None  # ... and the first data host leaves (scaled down) at this time
    pipeline: Optional[str] = None  # the producers' --pipeline REF (none: the built-in of --mode)
    pipeline_args: tuple[str, ...] = ()  # its --pipeline-arg K=V
    autoscale: Optional["AutoscaleOptions"] = None  # the pool follows the trainers' summed need (autoscaled.py)

    @property
    def elastic(self) -> bool:
        return self.add_host_at is not None or self.remove_host_at is not None or self.autoscale is not None


def start_producer(run: ClusterRun, cluster: LocalCluster, i: int) -> ProducerProcess:
    host = cluster.hosts[i]
    shard = "auto" if run.elastic else f"{i}/{run.hosts}"
    flags = produce_flags(workers=run.workers, batch_size=run.batch_size, mode=run.mode, image_size=run.image_size,
                          shard=shard, seed=run.seed, producer_id=f"{host.name}#{shard}", epochs=run.epochs,
                          min_trainers=run.trainers if run.epochs is not None and not run.elastic else None)
    if run.pipeline is not None:
        flags += ["--pipeline", run.pipeline, *(f for arg in run.pipeline_args for f in ("--pipeline-arg", arg))]
    producer = ProducerProcess(run.lmdb_path, bind=f"tcp://{host.address}:{PORT}", extra_args=flags,
                               command_prefix=host.command([]))
    print(f"{host.name}: producer on {producer.endpoint} (namespace {host.namespace}, "
          f"shard {shard}{', link ' + run.rate if run.rate else ''})", flush=True)
    return producer


def run_cluster(run: ClusterRun) -> int:
    """Run the job; return the worst trainer exit code. ClusterError if the harness cannot be built here."""
    if run.remove_host_at is not None and run.hosts + (run.add_host_at is not None) < 2:
        raise ClusterError("--remove-host-at needs a data host to remain: give --hosts 2 or more (or --add-host-at)")
    check_available()  # before anything else: say "needs root" rather than fail on a file
    if run.autoscale is not None:
        from stoker.cli.cluster.autoscaled import run_autoscaled

        return run_autoscaled(run, run.autoscale)
    with LmdbDataset(run.lmdb_path) as dataset:
        classes, records = len(dataset.meta.classes), dataset.meta.count
    exact = run.epochs is not None or run.elastic  # an elastic pool's splits are handed out in exact mode
    extra_host = 1 if run.add_host_at is not None else 0
    with LocalCluster(run.hosts + extra_host, rate=run.rate, trainers=run.trainers) as cluster:
        producers: list[ProducerProcess] = []
        names = PoolNames([t.namespace for t in cluster.trainers if t.namespace]) if run.elastic else None
        log_dir = Path(run.log_consumed or tempfile.mkdtemp(prefix="stoker-cluster-"))
        trainers_started: Optional[float] = None
        try:
            for i in range(run.hosts):
                producers.append(start_producer(run, cluster, i))
            if names is not None:
                names.set([h.address for h in cluster.hosts[:run.hosts]])
                connect = f"tcp://{POOL_NAME}:{PORT}"
                print(f"elastic pool: trainers connect to {connect} (resolved in their namespaces, re-resolved "
                      "every second)", flush=True)
            else:
                connect = ",".join(p.endpoint for p in producers)
            if run.log_consumed or run.elastic:
                log_dir.mkdir(parents=True, exist_ok=True)
            commands = []
            for j, trainer in enumerate(cluster.trainers):
                commands.append(trainer.command(train_command(
                    connect, model=run.model, steps=run.steps, batch_size=run.batch_size, image_size=run.image_size,
                    classes=classes, queue_capacity=run.queue_capacity, exact=exact,
                    trainer_id=trainer.name if exact else None,
                    discover_every=1.0 if run.elastic else None, share=(j, run.trainers) if run.elastic else None,
                    log_consumed=log_dir / f"{trainer.name}.jsonl" if run.log_consumed or run.elastic else None,
                    # progress bars of several trainers would garble each other
                    no_progress=run.no_progress or run.trainers > 1)))
                print(f"{trainer.name}: namespace {trainer.namespace}, address {trainer.address}", flush=True)
            trainers_started = time.monotonic()
            if run.elastic:
                assert names is not None
                watcher = ConsumedWatcher([log_dir / f"{t.name}.jsonl" for t in cluster.trainers])
                pool = _ElasticPool(run, cluster, producers, names, watcher)
                code = run_prefixed(commands, [t.name for t in cluster.trainers], tick=pool.tick)
                watcher.print_coverage(records)
                return code
            if len(commands) == 1:
                return subprocess.run(commands[0], stdin=subprocess.DEVNULL).returncode
            return run_prefixed(commands, [t.name for t in cluster.trainers])
        finally:
            trainers_ended = time.monotonic()
            for producer in producers:
                producer.stop()
            if trainers_started is not None:
                print("producers (each daemon's own count at its stop: batches made and sent, socket buffers "
                      "included: at least what the trainers took; images/s over its time in the run, from the "
                      "trainers' start or its own to its stop or theirs):", flush=True)
                for line in producer_lines(producers, trainers_started, trainers_ended):
                    print(f"  {line}", flush=True)
            if names is not None:
                names.close()
            if not run.log_consumed:
                shutil.rmtree(log_dir, ignore_errors=True)


def producer_lines(producers: Sequence[ProducerProcess], start: float, end: float) -> list[str]:
    """One line per stopped producer of a run from ``start`` to ``end`` (``time.monotonic()``): its id, and the
    batches and images its workers made to send (the daemon's "stopped" status line), with images/s over its time
    in the run: from ``start`` or its own start, whichever is later, to its stop or ``end``, whichever is earlier."""
    lines = []
    for producer in producers:
        counted = producer.counters()
        if counted is None:
            lines.append(f"{producer.producer_id}: no count (it exited without its final status line)")
            continue
        batches, images, _ = counted
        seconds = min(producer.stopped_at or end, end) - max(producer.started_at, start)
        rate = f"{images / seconds:.0f} images/s over {seconds:.1f} s" if seconds > 0 else "not timed (0 s in the run)"
        lines.append(f"{producer.producer_id}: {batches:,} batches, {images:,} images, {rate}")
    return lines


class _ElasticPool:
    """Adds and removes a data host on schedule and prints images/s every ``REPORT_EVERY_S``."""

    REPORT_EVERY_S = 5.0

    def __init__(self, run: ClusterRun, cluster: LocalCluster, producers: list[ProducerProcess], names: PoolNames,
                 watcher: ConsumedWatcher) -> None:
        self.run, self.cluster, self.producers, self.names, self.watcher = run, cluster, producers, names, watcher
        self.in_pool = list(range(run.hosts))
        self.started: Optional[float] = None  # the first consumed row: training is on
        self.added = self.removed = False
        self._last = (0.0, 0)

    def tick(self) -> None:
        now = time.monotonic()
        self.watcher.poll()
        if self.started is None:
            if not self.watcher.rows:
                return
            self.started, self._last = now, (now, self.watcher.rows)
        t = now - self.started
        if self.run.add_host_at is not None and not self.added and t >= self.run.add_host_at:
            self.added = True
            i = len(self.cluster.hosts) - 1
            self.producers.append(start_producer(self.run, self.cluster, i))
            self.in_pool.append(i)
            self.names.set([self.cluster.hosts[k].address for k in self.in_pool])
            print(f"cluster t={t:.0f}s: {self.cluster.hosts[i].name} joined the pool ({len(self.in_pool)} hosts)",
                  flush=True)
        if self.run.remove_host_at is not None and not self.removed and t >= self.run.remove_host_at:
            self.removed = True
            gone = self.in_pool.pop(0)
            self.names.set([self.cluster.hosts[k].address for k in self.in_pool])
            print(f"cluster t={t:.0f}s: {self.cluster.hosts[gone].name} left the pool ({len(self.in_pool)} hosts); "
                  "its producer stops", flush=True)
            self.producers[gone].stop()
        since, rows = self._last
        if now - since >= self.REPORT_EVERY_S:
            rate = (self.watcher.rows - rows) / (now - since)
            print(f"cluster t={t:.0f}s: {rate:.0f} images/s over the last {now - since:.0f} s, "
                  f"{len(self.in_pool)} data host(s) in the pool", flush=True)
            self._last = (now, self.watcher.rows)


def run_prefixed(commands: list[list[str]], names: list[str], tick: Optional[Callable[[], None]] = None) -> int:
    """Run the trainers at once, each output line prefixed with its name; the worst exit code.

    When one trainer fails the others are stopped: in a synchronous job (``--min-trainers``) they
    would wait for it for ever, kept alive by the producers' status messages.
    """
    procs = [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in commands]
    threads = [threading.Thread(target=_copy_lines, args=(p, name), daemon=True) for p, name in zip(procs, names)]
    for thread in threads:
        thread.start()
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            failed = [name for name, c in zip(names, codes) if c not in (None, 0)]
            if failed:
                print(f"cluster: {', '.join(failed)} failed; stopping the other trainers", flush=True)
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                codes = [_wait_or_kill(p) for p in procs]
                break
            if tick is not None:
                tick()
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for thread in threads:
        thread.join(5)
    return max(codes, key=abs)


def _wait_or_kill(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def _copy_lines(proc: subprocess.Popen, name: str) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        print(f"{name}: {line}", end="", flush=True)
