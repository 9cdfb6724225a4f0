"""``stoker train``'s flags: the trainer's settings (``TrainConfig``), every default and help text.

``add_train_parser`` adds the subcommand; ``cli/train/command.py`` runs it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stoker.cli.argument_parser import HelpFormatter, output_file, positive_int
from stoker.cli.train.command import cmd_train
from stoker.cli.train.local_producer_flags import add_local_producer_flags

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def trainer_id(text: str) -> str:
    from stoker.protocol.peer_ids import is_valid_id

    if not is_valid_id(text):
        raise argparse.ArgumentTypeError(f"{text!r} must be 1-128 printable ASCII characters without spaces")
    return text


def share(text: str) -> tuple[int, int]:
    try:
        rank, world = (int(x) for x in text.split("/"))
        if 0 <= rank < world:
            return rank, world
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK/WORLD with 0 <= RANK < WORLD, e.g. 0/2, got {text!r}")


def add_train_parser(sub: "Subcommands", common: argparse.ArgumentParser) -> None:
    """``stoker train``: the trainer's flags (``TrainConfig``)."""
    t = sub.add_parser("train", parents=[common], formatter_class=HelpFormatter, help="train a Keras model fed by producers",
                       description="Train a Keras model on batches from producer daemons through ZMQInput, with a "
                       "progress bar showing images/s and queue occupancy and TensorBoard summaries in --logdir.")
    t.add_argument("--connect", default=None,
                   help="comma-separated producer addresses, e.g. tcp://hostA:5555,tcp://hostB:5555; a host name "
                   "stands for every address it resolves to, re-resolved every --discover-every s (a Kubernetes "
                   "headless Service: tcp://stoker-producer.NAMESPACE.svc:5555 follows kubectl scale). Required "
                   "unless --local-producer is all the producers")
    t.add_argument("--discover-every", type=float, default=5.0, metavar="S",
                   help="seconds between re-resolving producer names (0: resolve once)")
    t.add_argument("--share", type=share, default="0/1", metavar="RANK/WORLD",
                   help="exact mode with an elastic pool (producers --shard auto): this trainer's share of each "
                   "epoch's splits, for data-parallel trainers")
    t.add_argument("--stall-after", type=float, default=10.0, metavar="S",
                   help="seconds a producer holding work may send nothing new while training waits before it counts "
                   "as stuck: an elastic pool hands its splits to the other producers, and the trainer logs what it "
                   "waits for (a floor: a pool whose producers go longer between batches waits 4x the median gap)")
    t.add_argument("--stall-limit", type=float, default=300.0, metavar="S",
                   help="exact mode with fixed shards: fail after a producer was stuck this long, naming it (no "
                   "other producer can serve its shard; it is warned about before, at a growing interval)")
    t.add_argument("--model", choices=("small-cnn", "resnet50"), default="small-cnn", help="model to train")
    t.add_argument("--steps", type=positive_int, default=1000, help="training steps")
    t.add_argument("--batch-size", type=positive_int, default=None,
                   help="batch size the producers send (default: learned from them; given, it is checked)")
    t.add_argument("--image-size", type=positive_int, default=None,
                   help="image size the producers send (default: learned from them; given, it is checked)")
    t.add_argument("--classes", type=positive_int, default=None,
                   help="classes of the model (labels must be below it); default: the producers' dataset's, which "
                        "their batch headers name (1000 if they do not); a value below the dataset's is refused")
    t.add_argument("--queue-capacity", type=positive_int, default=50, help="FIFOQueue capacity in batches")
    t.add_argument("--recv-timeout", type=float, default=60.0, help="seconds without any batch before training fails")
    t.add_argument("--logdir", default=None, help="TensorBoard log directory (none: no summaries)")
    t.add_argument("--log-every", type=positive_int, default=50, help="steps between occupancy log lines/summaries")
    t.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (none: off)")
    t.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    t.add_argument("--exact", action="store_true",
                   help="exact epochs (producers run --exact or --epochs N); training ends early when a finite run "
                   "of the producers does")
    t.add_argument("--trainer-id", default=None, type=trainer_id, help="exact mode: this trainer's id for the producers (default: random)")
    t.add_argument("--receive", choices=("auto", "direct", "libzmq"), default="auto",
                   help="how batches are received (default auto: direct where it applies, else libzmq). direct: each "
                   "producer's stream read over ZMTP straight into memory TensorFlow owns, one copy less per byte "
                   "and every message bounded (tcp:// and ipc:// addresses, plain or --exact; not with CurveZMQ keys); "
                   "libzmq: through libzmq (CurveZMQ)")
    t.add_argument("--log-consumed", default=None, metavar="FILE", type=output_file,
                   help="write each step's record indices and epochs as JSON lines, to verify coverage")
    t.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the model, the optimizer, the step and the input's state (exact mode: the records "
                   "trained) in DIR every --checkpoint-every steps, at the end and on Ctrl-C/SIGTERM (after a whole "
                   "step); a DIR holding a checkpoint needs --resume")
    t.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="steps between checkpoints (default: only at the end and on Ctrl-C/SIGTERM)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (none there: start afresh): with "
                   "--exact each record of the open epoch is trained once across the restart; --steps counts from "
                   "the first run. Refused, naming the flag, if the model, classes, batches, --share, --trainer-id or "
                   "the producers' dataset stream differ from the checkpoint's")
    t.add_argument("--report", default=None, metavar="FILE.html", type=output_file,
                   help="at the end (or on Ctrl-C/SIGTERM), write the bottleneck report: the verdict and, over "
                   "time, queue occupancy, step time, images/s per producer and producers' stage times (one self-contained HTML file)")
    t.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this trainer's NAME.key_secret: enables CurveZMQ (with --curve-server-key)")
    t.add_argument("--curve-server-key", default=None, metavar="FILE", help="the producers' public NAME.key")
    add_local_producer_flags(t)
    t.set_defaults(func=cmd_train)
