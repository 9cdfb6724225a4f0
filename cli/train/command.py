"""``stoker train``: train a Keras model fed by producers (``consumer/train/``), and say how it ended.

The flags are in ``cli/train/flags.py``. A flag to change (mismatched producers, classes, checkpoint) is exit 2
naming it; an input that fails is exit 1; Ctrl-C/SIGTERM after a whole step prints what was measured, exit 130.
"""

from __future__ import annotations

import argparse
import sys

from stoker.cli.exit_codes import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from stoker.cli.keys_command import curve_pair
from stoker.cli.train.local_producer_flags import local_producer_of
from stoker.cli.optional_extras import quiet_tensorflow


def cmd_train(args: argparse.Namespace) -> int:
    from stoker.protocol.curve import load_client_keys

    curve = (load_client_keys(args.curve_secret_key, args.curve_server_key)
             if curve_pair(args, "curve_secret_key", "curve_server_key") else None)
    if args.receive == "direct" and curve is not None:
        print("stoker train: error: --receive direct works without CurveZMQ keys; drop those or use --receive auto",
              file=sys.stderr)
        return EXIT_USAGE
    from stoker.consumer.receive.options import check_source

    try:
        local_producer = local_producer_of(args)
    except ValueError as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        connect = connect_addresses(args.connect or "")
        addresses = check_source(connect) if connect or local_producer is None else []
    except ValueError as exc:
        print(f"stoker train: error: --connect: {exc}", file=sys.stderr)
        return EXIT_USAGE
    quiet_tensorflow()  # usage errors above come before TensorFlow's import (seconds)
    from stoker.consumer.train.loop import TrainConfig, train

    config = TrainConfig(curve=curve, receive=args.receive,
        addresses=list(addresses), model=args.model, steps=args.steps,
        batch_size=args.batch_size, image_size=args.image_size, num_classes=args.classes,
        queue_capacity=args.queue_capacity, recv_timeout=args.recv_timeout, logdir=args.logdir,
        log_every=args.log_every, metrics_port=args.metrics_port, progress=not args.no_progress,
        exact=args.exact, trainer_id=args.trainer_id, consumed_log=args.log_consumed, report=args.report,
        discover_every=args.discover_every, share=args.share, stall_after=args.stall_after,
        stall_limit=args.stall_limit, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0,
        resume=args.resume, local_producer=local_producer,
    )
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        print("stoker train: error: --resume and --checkpoint-every need --checkpoint-dir DIR", file=sys.stderr)
        return EXIT_USAGE
    from stoker.consumer import InputError, InputMismatchError
    from stoker.consumer.placement.local_process import LocalProducerError
    from stoker.consumer.tf.summaries import TensorBoardNotInstalledError
    from stoker.consumer.train.checkpoints import CheckpointMismatchError
    from stoker.consumer.train.loop import TrainingInterrupted
    from stoker.consumer.train.models import ClassCountError

    try:
        report = train(config)
    except (TensorBoardNotInstalledError, InputMismatchError, ClassCountError, CheckpointMismatchError) as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)  # a flag to change, named
        return EXIT_USAGE
    except (InputError, LocalProducerError) as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except TrainingInterrupted as exc:  # after a whole step: what it measured, as at the end
        print("\n".join([exc.report.summary(), *exc.report.written()]))
        print("stoker train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print("\n".join([report.summary(), *report.written()]))
    return EXIT_OK


def connect_addresses(text: str) -> list[str]:
    """``--connect``'s comma-separated addresses, blanks left out."""
    return [a.strip() for a in text.split(",") if a.strip()]
