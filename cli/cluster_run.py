"""``stoker cluster``: producers on separate simulated hosts feeding trainers on others, on this machine.

Builds a LocalCluster (one network namespace per data host and per trainer host,
joined by a switch; data links optionally shaped with tc tbf), starts ``stoker
produce`` in every data host's namespace on its own address with a disjoint
shard, then runs ``stoker train`` in each trainer host's namespace pointed at all
of them. With ``epochs`` the producers run exact, finite epochs and wait until
every trainer joined; each trainer trains until the epochs end and can log what
it consumed, so coverage across trainers can be checked. Everything is torn down
when training ends, fails, or is interrupted: producers are stopped, any process
left in the namespaces is killed, the namespaces deleted.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from stoker.producer.dataset_format import LmdbDataset
from stoker.producer.process import ProducerProcess

from .local_cluster import LocalCluster, check_available

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
    train_args: Sequence[str] = ()
    trainers: int = 1
    epochs: Optional[int] = None  # exact, finite: the producers stop after these epochs, the trainers with them
    mode: str = "train"
    log_consumed: Optional[str] = None  # folder: trainer<j>.jsonl per trainer (each step's records)


def run_cluster(run: ClusterRun) -> int:
    """Run the job; return the worst trainer exit code. ClusterError if the harness cannot be built here."""
    check_available()  # before anything else: say "needs root" rather than fail on a file
    with LmdbDataset(run.lmdb_path) as dataset:
        classes = len(dataset.meta.classes)
    exact = run.epochs is not None
    with LocalCluster(run.hosts, rate=run.rate, trainers=run.trainers) as cluster:
        producers: list[ProducerProcess] = []
        try:
            for i, host in enumerate(cluster.hosts):
                flags = ["--workers", str(run.workers), "--batch-size", str(run.batch_size), "--mode", run.mode,
                         "--image-size", str(run.image_size), "--shard", f"{i}/{run.hosts}", "--seed", str(run.seed)]
                if exact:
                    flags += ["--epochs", str(run.epochs), "--min-trainers", str(run.trainers)]
                producers.append(ProducerProcess(run.lmdb_path, bind=f"tcp://{host.address}:{PORT}",
                                                 extra_args=flags, command_prefix=host.command([])))
                print(f"{host.name}: producer on {producers[-1].endpoint} (namespace {host.namespace}, "
                      f"shard {i}/{run.hosts}{', link ' + run.rate if run.rate else ''})", flush=True)
            connect = ",".join(p.endpoint for p in producers)
            if run.log_consumed:
                Path(run.log_consumed).mkdir(parents=True, exist_ok=True)
            commands = []
            for j, trainer in enumerate(cluster.trainers):
                extra = [*run.train_args]
                if exact:
                    extra += ["--exact", "--trainer-id", trainer.name]
                if run.log_consumed:
                    extra += ["--log-consumed", str(Path(run.log_consumed) / f"{trainer.name}.jsonl")]
                if run.trainers > 1 and "--no-progress" not in extra:
                    extra.append("--no-progress")  # progress bars of several trainers would garble each other
                commands.append(trainer.command([
                    sys.executable, "-m", "stoker.cli.main", "train", "--connect", connect, "--model", run.model,
                    "--steps", str(run.steps), "--batch-size", str(run.batch_size), "--image-size",
                    str(run.image_size), "--classes", str(classes), "--queue-capacity", str(run.queue_capacity),
                    *extra]))
                print(f"{trainer.name}: namespace {trainer.namespace}, address {trainer.address}", flush=True)
            if len(commands) == 1:
                return subprocess.run(commands[0], stdin=subprocess.DEVNULL).returncode
            return _run_prefixed(commands, [t.name for t in cluster.trainers])
        finally:
            for producer in producers:
                producer.stop()


def _run_prefixed(commands: list[list[str]], names: list[str]) -> int:
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
