"""``stoker demo``: the whole pipeline on one machine, on embedded synthetic data.

Builds (or reuses) a synthetic LMDB in the cache directory, starts two producer
daemons on loopback serving disjoint shards, trains a small CNN through
ZMQInput, then stops everything and checks that nothing is left running. The
producer's and the trainer's modules are imported when the demo runs, as every
command's are.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stoker.cli.argument_parser import HelpFormatter, positive_int
from stoker.cli.optional_extras import quiet_tensorflow

DEMO_CLASSES = 10


@dataclass(frozen=True)
class DemoConfig:
    cache_dir: str
    steps: int = 300
    records: int = 1024
    image_size: int = 64
    batch_size: int = 32
    workers: int = 1
    producers: int = 2


def demo_dataset(cache_dir: Path, records: int) -> Path:
    """The cached demo LMDB, built on first use (deterministic: seed 0); safe with several demos at once."""
    from stoker.producer.dataset.build.build_once import cached_dataset
    from stoker.producer.dataset.sources import DatasetError, LmdbDataset
    from stoker.producer.dataset.build.synthetic import build_synthetic

    path = cache_dir / f"demo-lmdb-{records}"

    def usable(p: Path) -> bool:
        try:
            with LmdbDataset(p) as ds:
                return len(ds) == records
        except DatasetError:
            return False

    def build(p: Path) -> None:
        print(f"building synthetic dataset: {records} JPEGs in {DEMO_CLASSES} classes at {p}", flush=True)
        build_synthetic(p, records, seed=0, num_classes=DEMO_CLASSES, overwrite=True)

    if usable(path):
        print(f"using cached synthetic dataset {path}")
        return path
    return cached_dataset(path, build, usable, say=lambda message: print(message, flush=True))


def run_demo(config: DemoConfig) -> int:
    from stoker.consumer.tf.summaries import optional_logdir
    from stoker.consumer.train.loop import TrainConfig, train
    from stoker.producer.process import ProducerProcess
    from stoker.producer.produce_command import produce_flags
    from stoker.producer.measure.procfs import running

    started = time.perf_counter()
    cache = Path(config.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    lmdb_path = demo_dataset(cache, config.records)
    logdir = optional_logdir(str(cache / "demo-tensorboard"))  # decided now, not at the first summary
    producers: list[ProducerProcess] = []
    try:
        for i in range(config.producers):
            args = produce_flags(workers=config.workers, batch_size=config.batch_size, image_size=config.image_size,
                                 shard=f"{i}/{config.producers}", seed=i, mode="train")
            producers.append(ProducerProcess(lmdb_path, extra_args=args, log_path=cache / f"demo-producer-{i}.log"))
            print(f"producer {i} serving shard {i}/{config.producers} on {producers[-1].endpoint} "
                  f"(log: {producers[-1].log_path})")
        child_pids = [pid for p in producers for pid in p.child_pids()]
        report = train(TrainConfig(
            addresses=[p.endpoint for p in producers], model="small-cnn", steps=config.steps,
            batch_size=config.batch_size, image_size=config.image_size, num_classes=DEMO_CLASSES,
            logdir=logdir, log_every=25,
        ))
    finally:
        exit_codes = [p.stop() for p in producers]
    time.sleep(0.2)
    leftover_procs = [pid for pid in child_pids + [p.pid for p in producers] if running(pid)]
    leftover_threads = [t.name for t in threading.enumerate() if t.name.startswith("stoker-")]
    print()
    print("=== Stoker demo ===")
    print(report.summary())
    if logdir:
        print(f"TensorBoard: tensorboard --logdir {logdir}")
    clean = all(code == 0 for code in exit_codes) and not leftover_procs and not leftover_threads
    if clean:
        print(f"shutdown: clean ({len(producers)} producers and their {len(child_pids)} child processes exited, "
              "input thread and socket closed)")
    else:
        print(f"shutdown: NOT clean: exit codes {exit_codes}, processes left {leftover_procs}, "
              f"threads left {leftover_threads}")
    print(f"demo took {time.perf_counter() - started:.0f} s")
    return 0 if clean else 1


def add_demo_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", common: argparse.ArgumentParser) -> None:
    """``stoker demo``."""
    d = sub.add_parser("demo", parents=[common], formatter_class=HelpFormatter, help="run the whole pipeline on this machine",
                       description="Build a small synthetic LMDB (cached), start two producer daemons on loopback "
                       "with disjoint shards, train a small CNN through ZMQInput and report images/s, queue "
                       "occupancy, the bottleneck, and a clean shutdown.")
    d.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "stoker"),
                   help="where the demo LMDB is kept between runs")
    d.add_argument("--steps", type=positive_int, default=300, help="training steps")
    d.add_argument("--records", type=positive_int, default=1024, help="synthetic images in the demo LMDB")
    d.add_argument("--image-size", type=positive_int, default=64, help="image size")
    d.add_argument("--batch-size", type=positive_int, default=32, help="batch size")
    d.add_argument("--workers", type=positive_int, default=1, help="worker processes per producer")
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    quiet_tensorflow()
    return run_demo(DemoConfig(cache_dir=args.cache_dir, steps=args.steps, records=args.records,
                               image_size=args.image_size, batch_size=args.batch_size, workers=args.workers))
