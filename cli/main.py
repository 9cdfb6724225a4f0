"""``stoker`` command line: a thin shell over the library. ``main()`` is the ``stoker`` entry point.

One folder or module per family of subcommands, each family's flags beside what runs them: ``produce/``,
``train/``, ``measure/`` (``bench``, ``doctor``), ``lmdb/``, ``data/`` (``index``, ``info``), ``cluster/``, and
``state_commands``, ``keys_command``, ``status``, ``demo``. This module composes their parsers under the global flags and maps what a
command raises to an exit code. Subcommands import what they need when they run, so ``stoker produce`` and
``stoker lmdb`` work on data hosts without TensorFlow installed.
Exit codes (``cli/exit_codes.py``): 0 ok, 1 runtime failure, 2 bad usage or unusable
input (the message says what to fix), 3 (``stoker status``) some metrics URLs down, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Sequence

from stoker.cli.argument_parser import HelpFormatter, StokerArgumentParser
from stoker.cli.cluster.command import add_cluster_parser
from stoker.cli.data.flags import add_data_parser
from stoker.cli.demo import add_demo_parser
from stoker.cli.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from stoker.cli.keys_command import add_keys_parser
from stoker.cli.lmdb.flags import add_lmdb_parser
from stoker.cli.measure.flags import add_bench_parser, add_doctor_parser
from stoker.cli.optional_extras import MissingExtraError
from stoker.cli.produce.flags import add_produce_parser
from stoker.cli.state_commands import add_state_parser
from stoker.cli.status import add_status_parser
from stoker.cli.train.flags import add_train_parser


def _setup_logging(verbose: bool, fmt: str) -> None:
    from stoker.producer.serve.logs import configure_logging

    configure_logging(logging.DEBUG if verbose else logging.INFO, fmt)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``stoker`` argument parser: the global flags, then each family's subcommands, whose parsers set
    ``args.func`` to the function that runs them."""
    parser = StokerArgumentParser(
        prog="stoker",
        description="Stoker keeps accelerators fed: producer daemons on CPU hosts decode and augment images from an "
        "LMDB and push uint8 batches over ZeroMQ to a TensorFlow trainer (ZMQInput -> FIFOQueue -> StagingArea).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="log lines as text or as one JSON object per line")
    # The same flags after the subcommand (`stoker produce ... --log-format json`); SUPPRESS keeps
    # the global value unless the flag is given there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    common.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                        help="log lines as text or as one JSON object per line (default: text)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In this order in `stoker --help`.
    for add in (add_lmdb_parser, add_data_parser, add_produce_parser, add_train_parser, add_state_parser,
                add_keys_parser, add_cluster_parser, add_status_parser, add_bench_parser, add_doctor_parser, add_demo_parser):
        add(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose, args.log_format)
    from stoker.producer.serve.daemon import BindError
    from stoker.producer.dataset.sources import DatasetError
    from stoker.producer.dataset.build.builder import SourceError

    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (DatasetError, SourceError, BindError, ValueError, FileNotFoundError, MissingExtraError) as exc:
        print(f"stoker {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PermissionError as exc:
        print(f"stoker {args.command}: error: {exc.strerror}: {exc.filename} (run as a user who may read it, "
              "or fix its permissions)", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `stoker lmdb info ... | head`: the reader left; that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        # Ctrl-C and SIGTERM (stoker train maps it) end here after everything was closed.
        print(f"stoker {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
