"""``stoker cluster``: producers on separate simulated hosts feeding one trainer, on this machine.

Builds a LocalCluster (one network namespace per data host, one for the trainer,
veth links optionally shaped with tc tbf), starts ``stoker produce`` in every
data host's namespace on its own address with a disjoint shard, then runs
``stoker train`` in the trainer's namespace pointed at all of them. Everything
is torn down when training ends, fails, or is interrupted: producers are
stopped, any process left in the namespaces is killed, the namespaces deleted.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
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


def run_cluster(run: ClusterRun) -> int:
    """Run the job; return the trainer's exit code. ClusterError if the harness cannot be built here."""
    check_available()  # before anything else: say "needs root" rather than fail on a file
    with LmdbDataset(run.lmdb_path) as dataset:
        classes = len(dataset.meta.classes)
    with LocalCluster(run.hosts, rate=run.rate) as cluster:
        producers: list[ProducerProcess] = []
        try:
            for i, host in enumerate(cluster.hosts):
                flags = ["--workers", str(run.workers), "--batch-size", str(run.batch_size),
                         "--image-size", str(run.image_size), "--shard", f"{i}/{run.hosts}", "--seed", str(run.seed)]
                producers.append(ProducerProcess(run.lmdb_path, bind=f"tcp://{host.address}:{PORT}",
                                                 extra_args=flags, command_prefix=host.command([])))
                print(f"{host.name}: producer on {producers[-1].endpoint} (namespace {host.namespace}, "
                      f"shard {i}/{run.hosts}{', link ' + run.rate if run.rate else ''})", flush=True)
            train = cluster.trainer.command([
                sys.executable, "-m", "stoker.cli.main", "train", "--connect", ",".join(p.endpoint for p in producers),
                "--model", run.model, "--steps", str(run.steps), "--batch-size", str(run.batch_size),
                "--image-size", str(run.image_size), "--classes", str(classes),
                "--queue-capacity", str(run.queue_capacity), *run.train_args])
            print(f"trainer: namespace {cluster.trainer.namespace}", flush=True)
            return subprocess.run(train, stdin=subprocess.DEVNULL).returncode
        finally:
            for producer in producers:
                producer.stop()
