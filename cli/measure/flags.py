"""``stoker bench producer|link|trainer`` and ``stoker doctor``'s flags: every default and help text.

``add_bench_parser`` and ``add_doctor_parser`` add the subcommands; ``cli/measure/commands.py`` runs them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stoker.cli.argument_parser import HelpFormatter, key_value, output_file, positive_int
from stoker.consumer.sizing.pool_sizing import DEFAULT_HEADROOM
from stoker.cli.measure.commands import cmd_bench_link, cmd_bench_pool, cmd_bench_producer, cmd_bench_trainer, cmd_doctor

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _add_stage_bench_flags(parser: argparse.ArgumentParser) -> None:
    """What ``bench producer`` and ``bench pool`` measure the stages on: the dataset, the output size, the time per
    stage, the pipeline and its arguments."""
    parser.add_argument("--data", "--lmdb", dest="lmdb", required=True, metavar="DATASET",
                        help="what `stoker produce --data` serves: an LMDB, a sharded dataset, a tar or Parquet index")
    parser.add_argument("--image-size", type=positive_int, default=224, help="output image size")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per stage")
    parser.add_argument("--pipeline", default="imagenet", metavar="NAME", help="pipeline, as for stoker produce")
    parser.add_argument("--pipeline-arg", action="append", type=key_value, metavar="KEY=VALUE",
                        help="pipeline argument (repeatable)")


def add_bench_parser(sub: "Subcommands", common: argparse.ArgumentParser) -> None:
    """``stoker bench producer|link|trainer``."""
    be = sub.add_parser("bench", parents=[common], formatter_class=HelpFormatter, help="measure one stage on its own",
                        description="Measure each stage alone, to find the bottleneck: `producer` (read, decode, "
                        "augment, serialize on one core), `link` (what arrives here from producers), `trainer` "
                        "(the step on constant input).")
    besub = be.add_subparsers(dest="bench_command", required=True, metavar="STAGE")
    bp = besub.add_parser("producer", parents=[common], formatter_class=HelpFormatter, help="producer stages, one core")
    _add_stage_bench_flags(bp)
    bp.add_argument("--batch-size", type=positive_int, default=64, help="batch size (serialize stage)")
    bp.add_argument("--mode", choices=("train", "eval"), default="train", help="pipeline mode")
    bp.set_defaults(func=cmd_bench_producer)
    bo = besub.add_parser("pool", parents=[common], formatter_class=HelpFormatter, help="data hosts for a demand",
                          description="Measure one core's images/s on your own pipeline and data (as `bench producer`), "
                          "then print the decode workers and data hosts a trainer demand needs, with headroom. The demand "
                          "of a running job: its trainers' stoker_trainer_demand_images_per_s (summed), or "
                          "`stoker bench trainer`'s images/s times the trainers.")
    _add_stage_bench_flags(bo)
    bo.add_argument("--demand", type=float, required=True, metavar="IMAGES_PER_S",
                    help="images/s the job's trainers take together when never waiting")
    bo.add_argument("--cores-per-host", type=positive_int, default=16, help="cores of one data host")
    bo.add_argument("--workers-per-host", type=positive_int, help="decode workers per host (default: cores - 1)")
    bo.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                    help="supply kept above demand (as the trainers' estimate)")
    bo.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    bo.set_defaults(func=cmd_bench_pool, mode="train", batch_size=64)
    bl = besub.add_parser("link", parents=[common], formatter_class=HelpFormatter, help="what arrives from producers",
                          description="Receive and validate batches from producers (no TensorFlow) and report "
                          "images/s and MB/s. Note: this takes batches a running trainer would otherwise get. Plain-mode "
                          "producers only: exact-mode ones are named and refused (exit 2).")
    bl.add_argument("--connect", required=True, help="comma-separated producer addresses")
    bl.add_argument("--seconds", type=float, default=5.0, help="measuring time after a 3-batch warm-up")
    bl.set_defaults(func=cmd_bench_link)
    bt = besub.add_parser("trainer", parents=[common], formatter_class=HelpFormatter, help="the step on constant input")
    bt.add_argument("--model", choices=("small-cnn", "resnet50"), default="resnet50", help="model")
    bt.add_argument("--batch-size", type=positive_int, default=64, help="batch size")
    bt.add_argument("--image-size", type=positive_int, default=224, help="image size")
    bt.add_argument("--classes", type=positive_int, default=1000, help="number of classes")
    bt.add_argument("--steps", type=positive_int, default=20, help="timed steps after 3 warm-up steps")
    bt.set_defaults(func=cmd_bench_trainer)


def add_doctor_parser(sub: "Subcommands", common: argparse.ArgumentParser) -> None:
    """``stoker doctor``."""
    dr = sub.add_parser("doctor", parents=[common], formatter_class=HelpFormatter, help="which side limits training",
                        description="Measure what arrives from the producers and what the training step can take "
                        "on constant input, then say in one sentence which side limits training and what to do.")
    dr.add_argument("--connect", required=True, help="comma-separated producer addresses")
    dr.add_argument("--model", choices=("small-cnn", "resnet50"), default="resnet50", help="model")
    dr.add_argument("--batch-size", type=positive_int, default=64, help="batch size the producers send")
    dr.add_argument("--image-size", type=positive_int, default=224, help="image size the producers send")
    dr.add_argument("--classes", type=positive_int, default=1000, help="number of classes")
    dr.add_argument("--steps", type=positive_int, default=10, help="timed trainer steps")
    dr.add_argument("--seconds", type=float, default=5.0, help="seconds of link measurement")
    dr.add_argument("--lmdb", default=None, help="also time the producer stages on this LMDB (local copy)")
    dr.add_argument("--report", default=None, metavar="FILE.html", type=output_file,
                    help="also train for --report-steps steps and write the bottleneck report (verdict, and over "
                    "time queue occupancy, step time, images/s per producer, producers' stage times)")
    dr.add_argument("--report-steps", type=positive_int, default=60, help="steps of the real run for --report")
    dr.set_defaults(func=cmd_doctor)
