"""``stoker train --local-producer N``: a producer on the trainer's host, its flags and the ``LocalProducer`` they make.

The producer is started by the trainer's input (``consumer/placement/``) over ``ipc://``, niced below the training
step, and joins the pool beside the ``--connect`` producers, with the same dataset and ``stoker produce`` flags.
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Optional

from stoker.cli.argument_parser import positive_int

if TYPE_CHECKING:
    from stoker.consumer.placement.local_producer import LocalProducer


def cpu_list(text: str) -> tuple[int, ...]:
    from stoker.consumer.placement.local_producer import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_local_producer_flags(t: argparse.ArgumentParser) -> None:
    """The ``--local-producer*`` flags of ``stoker train``."""
    t.add_argument("--local-producer", type=positive_int, default=None, metavar="WORKERS",
                   help="also start a producer of WORKERS processes on this host (its spare cores first, Pecan's "
                   "AutoPlacement), over ipc://, niced below the training step; it joins the pool beside the "
                   "--connect producers (which may then be left out) and stops with training. Needs "
                   "--local-producer-data")
    t.add_argument("--local-producer-data", default=None, metavar="LOCATION",
                   help="the dataset the remote producers serve (their --data: path, URL or .json index)")
    t.add_argument("--local-producer-flags", default="", metavar="'FLAGS'",
                   help="the other stoker produce flags the remote producers run with, as one quoted argument, e.g. "
                   "'--pipeline imagenet --batch-size 64 --image-size 224' (with --exact: '--shard auto --seed 0 ...')")
    t.add_argument("--local-producer-cpus", type=cpu_list, default=None, metavar="LIST",
                   help="cores the local producer may use, e.g. 4-7 or 2,3 (default: any); those the step leaves idle")
    t.add_argument("--local-producer-nice", type=int, default=10, metavar="N",
                   help="how much lower its priority is than training's (0-19)")


def local_producer_of(args: argparse.Namespace) -> Optional["LocalProducer"]:
    """The ``LocalProducer`` the flags ask for (None without ``--local-producer``); ValueError naming the flag."""
    from stoker.consumer.placement.local_producer import LocalProducer

    others = (args.local_producer_data, args.local_producer_flags, args.local_producer_cpus)
    if args.local_producer is None:
        if any(others) or args.local_producer_nice != 10:
            raise ValueError("--local-producer-* flags set a local producer up: add --local-producer WORKERS")
        return None
    if not args.local_producer_data:
        raise ValueError("--local-producer needs --local-producer-data LOCATION: the dataset the remote producers "
                         "serve")
    try:
        flags = shlex.split(args.local_producer_flags)
    except ValueError as exc:
        raise ValueError(f"--local-producer-flags: {exc} (quote the flags as one argument)") from None
    try:
        local = LocalProducer(args.local_producer_data, workers=args.local_producer, extra_flags=flags,
                              cpus=args.local_producer_cpus, nice=args.local_producer_nice)
        local.check_mode(args.exact)
        return local
    except ValueError as exc:
        raise ValueError(str(exc).replace("local_producer ", "--local-producer: ", 1)) from None
