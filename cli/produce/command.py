"""``stoker produce``: run a producer daemon until SIGTERM/SIGINT, or until the process that started it is gone.

The flags are in ``cli/produce/flags.py``. A worker crash loop ends it with exit 1 (the cause in the log and in the
status file's ``stopped`` line); the daemon imports only when the command runs, so data hosts need no TensorFlow.
"""

from __future__ import annotations

import argparse
import sys

from stoker.cli.exit_codes import EXIT_FAILURE, EXIT_OK
from stoker.cli.keys_command import curve_pair
from stoker.cli.lmdb.storage_flags import storage_of
from stoker.cli.shutdown import stop_event_on_signals, stop_with_process


def cmd_produce(args: argparse.Namespace) -> int:
    from stoker.producer.serve.daemon import ProducerConfig, ProducerDaemon
    from stoker.producer.serve.sharding import ShardSpec
    from stoker.protocol.curve import load_server_keys

    curve = (load_server_keys(args.curve_secret_key, args.curve_authorized_keys)
             if curve_pair(args, "curve_secret_key", "curve_authorized_keys") else None)
    config = ProducerConfig(curve=curve,
        lmdb_path=args.lmdb, bind=args.bind, workers=args.workers, batch_size=args.batch_size,
        image_size=args.image_size, mode=args.mode, pipeline=args.pipeline,
        pipeline_args=tuple(args.pipeline_arg or ()), shard=ShardSpec.parse(args.shard), seed=args.seed,
        shuffle_window=args.shuffle_window, shard_affinity=args.shard_affinity == "on",
        epoch_order=0 if args.epoch_order == "auto" else int(args.epoch_order),
        sndhwm=args.sndhwm, log_interval=args.log_interval, producer_id=args.id,
        metrics_port=args.metrics_port, log_format=getattr(args, "log_format", "text"),
        repeat_batches=args.repeat_batches,
        fast_dct=args.fast_dct, exact=args.exact, epochs=args.epochs, trainer_timeout=args.trainer_timeout,
        min_trainers=args.min_trainers, status_file=args.status_file,
        remote=storage_of(args, cache_dir=args.cache_dir, cache_bytes=args.cache_size,
                          retry_seconds=args.fetch_retry_seconds),
    )
    stop = stop_event_on_signals()
    if args.parent_pid is not None:
        stop_with_process(args.parent_pid, stop)
    from stoker.producer.supervision.worker_supervisor import WorkerCrashLoop

    try:
        ProducerDaemon(config, cancel=stop).run(stop)  # a signal also ends its wait for storage at start
    except WorkerCrashLoop as exc:  # logged, and in the status file's "stopped" line
        print(f"stoker produce: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
