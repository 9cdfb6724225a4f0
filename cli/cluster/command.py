"""``stoker cluster``: its flags and what runs it: producers on simulated hosts feeding trainers, on this machine.

The hosts are network namespaces (``local_cluster.py``), the run and its teardown ``run.py``, the elastic pool's
name and what the trainers consumed ``elastic.py``; ``--autoscale``: ``autoscaled.py`` (the controller
``autoscale.py``, the hosts ``scaled_pool.py``). Needs root and iproute2; a missing one is exit 2, named.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from stoker.cli.argument_parser import HelpFormatter, positive_int
from stoker.cli.exit_codes import EXIT_USAGE

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def add_cluster_parser(sub: "Subcommands", common: argparse.ArgumentParser) -> None:
    """``stoker cluster``: simulated hosts on this machine (``ClusterRun``)."""
    cl = sub.add_parser("cluster", parents=[common], formatter_class=HelpFormatter,
                        help="producers on simulated hosts feeding trainers, on this machine (root)",
                        description="Build HOSTS data hosts and TRAINERS trainer hosts on this machine with network "
                        "namespaces joined by a switch (each host its own address in 10.213.0.0/24; data links "
                        "optionally shaped with tc tbf), run a producer with a disjoint shard on each data host and "
                        "`stoker train` on each trainer host, then tear everything down, also after a failure or "
                        "Ctrl-C. Needs root and iproute2.")
    cl.add_argument("--lmdb", required=True, help="Stoker LMDB every producer serves (a shard each)")
    cl.add_argument("--hosts", type=positive_int, default=2, help="number of data hosts (1-64)")
    cl.add_argument("--trainers", type=positive_int, default=1,
                    help="number of trainer hosts (1-16), each running `stoker train` against every producer")
    cl.add_argument("--epochs", type=positive_int, default=None,
                    help="exact, finite epochs: producers stop after them (waiting for every trainer to join "
                    "first), and the trainers with them; none: endless producers, --steps decides")
    cl.add_argument("--mode", choices=("train", "eval"), default="train", help="producers' mode")
    cl.add_argument("--log-consumed", default=None, metavar="DIR",
                    help="each trainer writes DIR/<name>.jsonl: every step's record indices and epochs")
    cl.add_argument("--rate", default=None, help="shape each link, e.g. 1gbit or 10gbit (none: unshaped)")
    cl.add_argument("--workers", type=positive_int, default=1, help="worker processes per producer")
    cl.add_argument("--batch-size", type=positive_int, default=64, help="images per batch")
    cl.add_argument("--image-size", type=positive_int, default=224, help="image size in pixels")
    cl.add_argument("--model", choices=("small-cnn", "resnet50"), default="small-cnn", help="model to train")
    cl.add_argument("--steps", type=positive_int, default=200, help="training steps")
    cl.add_argument("--queue-capacity", type=positive_int, default=50, help="trainer's FIFOQueue capacity in batches")
    cl.add_argument("--seed", type=int, default=0, help="producers' seed")
    cl.add_argument("--add-host-at", type=float, default=None, metavar="S",
                    help="elastic pool: one more data host joins S seconds into training (producers run --shard auto "
                    "and the trainers find them by name); prints images/s over time and each epoch's coverage")
    cl.add_argument("--remove-host-at", type=float, default=None, metavar="S",
                    help="elastic pool: the first data host leaves S seconds into training (scaled down)")
    cl.add_argument("--no-progress", action="store_true", help="log lines instead of the trainer's progress bar")
    cl.add_argument("--pipeline", default=None, metavar="REF",
                    help="the producers' pipeline (path/file.py:make_pipeline or module:attr; none: the built-in)")
    cl.add_argument("--pipeline-arg", action="append", metavar="K=V",
                    help="argument of --pipeline (repeatable), passed to each producer")
    au = cl.add_argument_group("autoscale", "--autoscale: an elastic pool of --min-producers to --max-producers "
                               "data hosts follows the trainers' summed stoker_trainer_producers_needed, rounded once "
                               "(up at once, down after --autoscale-down-hold, newest host first, its splits handed "
                               "back); every decision is logged with its inputs")
    au.add_argument("--autoscale", action="store_true", help="size the pool from the trainers' metrics")
    au.add_argument("--autoscale-metrics", default=None, metavar="URL[,URL...]",
                    help="trainer metrics URLs to read (default: the cluster's own trainers')")
    au.add_argument("--min-producers", type=positive_int, default=1, help="smallest pool")
    au.add_argument("--max-producers", type=positive_int, default=8, help="largest pool (data hosts made, <= 64)")
    au.add_argument("--autoscale-interval", type=float, default=5.0, metavar="S", help="seconds between decisions")
    au.add_argument("--autoscale-down-hold", type=float, default=60.0, metavar="S",
                    help="the need must stay below the pool for S seconds before a host leaves")
    cl.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    from stoker.cli.cluster.local_cluster import ClusterError
    from stoker.cli.cluster.run import ClusterRun, run_cluster

    run = ClusterRun(lmdb_path=args.lmdb, hosts=args.hosts, rate=args.rate, workers=args.workers,
                     batch_size=args.batch_size, image_size=args.image_size, model=args.model, steps=args.steps,
                     queue_capacity=args.queue_capacity, seed=args.seed,
                     no_progress=args.no_progress, trainers=args.trainers,
                     epochs=args.epochs, mode=args.mode, log_consumed=args.log_consumed,
                     add_host_at=args.add_host_at, remove_host_at=args.remove_host_at,
                     pipeline=args.pipeline, pipeline_args=tuple(args.pipeline_arg or ()))
    if args.autoscale:
        from stoker.cli.cluster.autoscaled import AutoscaleOptions

        if args.add_host_at is not None or args.remove_host_at is not None:
            print("stoker cluster: error: --autoscale sizes the pool itself: leave out --add-host-at and "
                  "--remove-host-at", file=sys.stderr)
            return EXIT_USAGE
        try:
            options = AutoscaleOptions(
                metrics=tuple(u for u in (args.autoscale_metrics or "").split(",") if u),
                min_producers=args.min_producers, max_producers=args.max_producers,
                interval_s=args.autoscale_interval, down_hold_s=args.autoscale_down_hold)
        except ValueError as exc:
            print(f"stoker cluster: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        run = dataclasses.replace(run, autoscale=options)
    try:
        return run_cluster(run)
    except ClusterError as exc:
        print(f"stoker cluster: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
