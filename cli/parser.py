"""The ``stoker`` command line's arguments: every command, flag, default and help text.

Kept apart from ``cli/main.py`` (which runs the commands) so that what a user can type is
one readable file: one ``_add_COMMAND`` function per subcommand, composed by ``build_parser``.
Types here validate flags and raise ``argparse.ArgumentTypeError`` with the fix.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Callable, Mapping

from stoker.cli.argument_parser import HelpFormatter, StokerArgumentParser
from stoker.cli.argument_parser import key_value as _key_value
from stoker.cli.argument_parser import positive_int as _positive_int
from stoker.cli.lmdb_commands import size_argument, add_lmdb_parser, add_storage_arguments
from stoker.cli.state_commands import add_state_parser


def _output_file(text: str) -> str:
    """A file we will write at the end of a long run: refuse now a folder that is missing or read-only."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder} is not writable")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    return text


def _trainer_id(text: str) -> str:
    from stoker.protocol.batch_codec import is_valid_id

    if not is_valid_id(text):
        raise argparse.ArgumentTypeError(f"{text!r} must be 1-128 printable ASCII characters without spaces")
    return text


def _share(text: str) -> tuple[int, int]:
    try:
        rank, world = (int(x) for x in text.split("/"))
        if 0 <= rank < world:
            return rank, world
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK/WORLD with 0 <= RANK < WORLD, e.g. 0/2, got {text!r}")


Handlers = Mapping[str, Callable[[argparse.Namespace], int]]
if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _add_dataset_source(p: argparse.ArgumentParser) -> None:
    """``stoker produce``'s dataset: where it is, and how shards from object storage are cached and ordered."""
    p.add_argument("--lmdb", required=True, help="the dataset: an LMDB folder, a sharded dataset's folder, or a "
                   "sharded dataset in object storage (s3://bucket/prefix, any fsspec URL; shards fetched into "
                   "--cache-dir as they are needed)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="object storage: where fetched shards are kept (default: ~/.cache/stoker/shards)")
    p.add_argument("--cache-size", type=size_argument, default=None, metavar="SIZE",
                   help="object storage: the cache's disk budget, least recently used shards evicted first (e.g. "
                   "50GB; default: 64GB)")
    p.add_argument("--fetch-retry-seconds", type=float, default=300.0, metavar="S",
                   help="object storage: how long a failing fetch is retried (backoff 0.5-8 s) before its shard's "
                   "records are skipped and counted")
    p.add_argument("--shuffle-window", type=int, default=1, metavar="SHARDS",
                   help="a sharded dataset: each epoch shuffles the shards, then the records within each window of "
                   "this many consecutive shards, so a producer works on few shards at a time; with --shard auto the "
                   "trainers hand each split to a producer whose cache holds its shard, and a fixed --shard I/N is "
                   "whole dataset shards (j %% N == I). Larger windows mix more shards into each batch and fetch "
                   "more; 0: one shuffle of the whole dataset and fixed shards of every N-th record (as before "
                   "sharded datasets). The same on every producer of a job")
    p.add_argument("--shard-affinity", choices=("on", "off"), default="on",
                   help="--shard auto from object storage: tell the trainers which shards this host's cache holds, "
                   "so they hand it the splits of those shards and each host fetches mostly its own (default on); "
                   "off: they hand it any split (the baseline of benchmarks/shard_fetches.py)")


def _add_produce(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker produce``: the daemon's flags (``ProducerConfig``)."""
    p = sub.add_parser("produce", parents=[common], formatter_class=HelpFormatter, help="run a producer daemon",
                       description="Serve batches made by a pipeline from an LMDB on a ZMQ PUSH socket until "
                       "SIGTERM/SIGINT. The default imagenet pipeline sends images uint8 [B,H,W,3] RGB and labels "
                       "int32 [B]; every batch also carries index int64 [B] and epoch int32 [B] (which record, which "
                       "epoch). Pipelines: imagenet, detection, segmentation, or your own "
                       "(--pipeline my_module:make_pipeline or path/to/file.py:make_pipeline).")
    _add_dataset_source(p)
    add_storage_arguments(p)
    p.add_argument("--bind", default="tcp://*:5555", help="ZMQ address to bind; trainers connect to it")
    p.add_argument("--workers", type=_positive_int, default=os.cpu_count() or 1, help="decode/augment processes")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="images per batch")
    p.add_argument("--image-size", type=_positive_int, default=224,
                   help="output height and width in pixels, for pipelines that take image_size (the built-ins; "
                   "--pipeline-arg size=HxW for non-square)")
    p.add_argument("--mode", choices=("train", "eval"), default="train",
                   help="train: random augmentation (imagenet: random-resized-crop + flip); eval: deterministic "
                   "(imagenet: resize + centre crop); passed to pipelines that take mode")
    p.add_argument("--pipeline", default="imagenet", metavar="NAME",
                   help="imagenet, detection, segmentation, package.module:function or path/file.py:function "
                   "(a function returning a stoker.producer.pipeline.Pipeline; see README)")
    p.add_argument("--pipeline-arg", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="argument for the pipeline function, converted to its parameter's type (repeatable), e.g. "
                   "size=224x320, flip=false, max_boxes=50")
    p.add_argument("--fast-dct", action="store_true",
                   help="decode JPEGs with libjpeg-turbo's fast integer IDCT and chroma upsampling: ~6%% faster "
                   "(benchmarks/decoders.py), pixels differ by ~3 levels on average (like tf.image INTEGER_FAST); "
                   "off: exact decode")
    p.add_argument("--shard", default="0/1",
                   help="serve shard I of N (records with index %% N == I); auto: join an elastic pool, where the "
                   "trainers hand out splits of each epoch to whichever producers are up, so producers may join and "
                   "leave a running job (implies --exact; every producer of a pool needs the same --seed)")
    p.add_argument("--exact", action="store_true",
                   help="exact epochs: each record once per epoch through producer crashes and trainer restarts "
                   "(trainers must use ZMQInput(..., exact=True) / stoker train --exact; see README)")
    p.add_argument("--epochs", type=_positive_int, default=None,
                   help="serve exactly this many epochs, then stop (implies --exact); none: endless")
    p.add_argument("--min-trainers", type=_positive_int, default=1,
                   help="exact mode: serve nothing until this many trainers joined, so in a synchronous "
                   "data-parallel job no trainer starts ahead of the others")
    p.add_argument("--trainer-timeout", type=float, default=10.0,
                   help="exact mode: seconds without a message before a trainer is taken for dead and the records "
                   "it held are served again")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for epoch order and augmentation (default: random, logged; with --shard auto: 0)")
    p.add_argument("--sndhwm", type=_positive_int, default=2,
                   help="batches queued on the trainer-facing socket before backpressure; each worker decodes into "
                   "SNDHWM+1 shared-memory batch slots, so memory ~ workers x (SNDHWM+1) x batch bytes")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between rate log lines")
    p.add_argument("--id", default=None,
                   help="producer id in headers (default: HOST:PORT#SHARD~INSTANCE, INSTANCE 6 random hex digits, "
                   "so every daemon, a restarted one too, is its own entry in a trainer's stats)")
    p.add_argument("--parent-pid", type=_positive_int, default=None, metavar="PID",
                   help="shut down when process PID exits (for launchers: a test run or a harness killed outright "
                   "leaves no producer behind); none: run until SIGTERM/SIGINT")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (none: off)")
    p.add_argument("--repeat-batches", type=int, default=0, metavar="K",
                   help="benchmarking only: each worker makes K real batches, then re-sends them as fast as the "
                   "network takes them (isolates transport and trainer from decoding); 0: off")
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this producer's NAME.key_secret: enables CurveZMQ encryption (with --curve-authorized-keys)")
    p.add_argument("--curve-authorized-keys", default=None, metavar="DIR",
                   help="folder of trainer public keys (*.key) allowed to connect")
    p.add_argument("--status-file", default=None, metavar="FILE", type=_output_file,
                   help="for launchers: write JSON lines made for programs to FILE (truncated at start), one when "
                   "serving (endpoint, producer id, pid, mode) and one at the stop (batches, images, records skipped); "
                   "read it, not the log, whose wording may change; none: no file")
    p.set_defaults(func=handlers["produce"])


def _add_train(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker train``: the trainer's flags (``TrainConfig``)."""
    t = sub.add_parser("train", parents=[common], formatter_class=HelpFormatter, help="train a Keras model fed by producers",
                       description="Train a Keras model on batches from producer daemons through ZMQInput, with a "
                       "progress bar showing images/s and queue occupancy and TensorBoard summaries in --logdir.")
    t.add_argument("--connect", required=True,
                   help="comma-separated producer addresses, e.g. tcp://hostA:5555,tcp://hostB:5555; a host name "
                   "stands for every address it resolves to, re-resolved every --discover-every s (a Kubernetes "
                   "headless Service: tcp://stoker-producer.NAMESPACE.svc:5555 follows kubectl scale)")
    t.add_argument("--discover-every", type=float, default=5.0, metavar="S",
                   help="seconds between re-resolving producer names (0: resolve once)")
    t.add_argument("--share", type=_share, default="0/1", metavar="RANK/WORLD",
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
    t.add_argument("--steps", type=_positive_int, default=1000, help="training steps")
    t.add_argument("--batch-size", type=_positive_int, default=None,
                   help="batch size the producers send (default: learned from them; given, it is checked)")
    t.add_argument("--image-size", type=_positive_int, default=None,
                   help="image size the producers send (default: learned from them; given, it is checked)")
    t.add_argument("--classes", type=_positive_int, default=None,
                   help="classes of the model (labels must be below it); default: the producers' dataset's, which "
                        "their batch headers name (1000 if they do not); a value below the dataset's is refused")
    t.add_argument("--queue-capacity", type=_positive_int, default=50, help="FIFOQueue capacity in batches")
    t.add_argument("--recv-timeout", type=float, default=60.0, help="seconds without any batch before training fails")
    t.add_argument("--logdir", default=None, help="TensorBoard log directory (none: no summaries)")
    t.add_argument("--log-every", type=_positive_int, default=50, help="steps between occupancy log lines/summaries")
    t.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (none: off)")
    t.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    t.add_argument("--exact", action="store_true",
                   help="exact epochs (producers run --exact or --epochs N); training ends early when a finite run "
                   "of the producers does")
    t.add_argument("--trainer-id", default=None, type=_trainer_id, help="exact mode: this trainer's id for the producers (default: random)")
    t.add_argument("--receive", choices=("auto", "direct", "libzmq"), default="auto",
                   help="how batches are received (default auto: direct where it applies, else libzmq). direct: each "
                   "producer's stream read over ZMTP straight into memory TensorFlow owns, one copy less per byte "
                   "and every message bounded (tcp:// addresses, plain or --exact; not with CurveZMQ keys); libzmq: "
                   "through libzmq (CurveZMQ, ipc://)")
    t.add_argument("--log-consumed", default=None, metavar="FILE", type=_output_file,
                   help="write each step's record indices and epochs as JSON lines, to verify coverage")
    t.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the model, the optimizer, the step and the input's state (exact mode: the records "
                   "trained) in DIR every --checkpoint-every steps, at the end and on Ctrl-C/SIGTERM (after a whole "
                   "step); a DIR holding a checkpoint needs --resume")
    t.add_argument("--checkpoint-every", type=_positive_int, default=None, metavar="N",
                   help="steps between checkpoints (default: only at the end and on Ctrl-C/SIGTERM)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (none there: start afresh): with "
                   "--exact each record of the open epoch is trained once across the restart; --steps counts from "
                   "the first run. Refused, naming the flag, if the model, classes, batches, --share, --trainer-id or "
                   "the producers' dataset stream differ from the checkpoint's")
    t.add_argument("--report", default=None, metavar="FILE.html", type=_output_file,
                   help="at the end (or on Ctrl-C/SIGTERM), write the bottleneck report: the verdict and, over "
                   "time, queue occupancy, step time, images/s per producer and producers' stage times (one self-contained HTML file)")
    t.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this trainer's NAME.key_secret: enables CurveZMQ (with --curve-server-key)")
    t.add_argument("--curve-server-key", default=None, metavar="FILE", help="the producers' public NAME.key")
    t.set_defaults(func=handlers["train"])


def _add_keys(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker keys generate``."""
    k = sub.add_parser("keys", parents=[common], formatter_class=HelpFormatter, help="make CurveZMQ key pairs",
                       description="CurveZMQ keys encrypt batches and let producers accept only known trainers. "
                       "Producers: --curve-secret-key server.key_secret --curve-authorized-keys DIR_OF_CLIENT_KEYS. "
                       "Trainers: --curve-secret-key client.key_secret --curve-server-key server.key.")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kg = ksub.add_parser("generate", parents=[common], formatter_class=HelpFormatter, help="write NAME.key and NAME.key_secret",
                         description="Write a key pair: DIR/NAME.key (public, share it) and DIR/NAME.key_secret "
                         "(secret, mode 600).")
    kg.add_argument("dir", help="folder to write the key files into")
    kg.add_argument("--name", default="stoker", help="file name stem")
    kg.set_defaults(func=handlers["keys_generate"])


def _add_cluster(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker cluster``: simulated hosts on this machine (``ClusterRun``)."""
    cl = sub.add_parser("cluster", parents=[common], formatter_class=HelpFormatter,
                        help="producers on simulated hosts feeding trainers, on this machine (root)",
                        description="Build HOSTS data hosts and TRAINERS trainer hosts on this machine with network "
                        "namespaces joined by a switch (each host its own address in 10.213.0.0/24; data links "
                        "optionally shaped with tc tbf), run a producer with a disjoint shard on each data host and "
                        "`stoker train` on each trainer host, then tear everything down, also after a failure or "
                        "Ctrl-C. Needs root and iproute2.")
    cl.add_argument("--lmdb", required=True, help="Stoker LMDB every producer serves (a shard each)")
    cl.add_argument("--hosts", type=_positive_int, default=2, help="number of data hosts (1-64)")
    cl.add_argument("--trainers", type=_positive_int, default=1,
                    help="number of trainer hosts (1-16), each running `stoker train` against every producer")
    cl.add_argument("--epochs", type=_positive_int, default=None,
                    help="exact, finite epochs: producers stop after them (waiting for every trainer to join "
                    "first), and the trainers with them; none: endless producers, --steps decides")
    cl.add_argument("--mode", choices=("train", "eval"), default="train", help="producers' mode")
    cl.add_argument("--log-consumed", default=None, metavar="DIR",
                    help="each trainer writes DIR/<name>.jsonl: every step's record indices and epochs")
    cl.add_argument("--rate", default=None, help="shape each link, e.g. 1gbit or 10gbit (none: unshaped)")
    cl.add_argument("--workers", type=_positive_int, default=1, help="worker processes per producer")
    cl.add_argument("--batch-size", type=_positive_int, default=64, help="images per batch")
    cl.add_argument("--image-size", type=_positive_int, default=224, help="image size in pixels")
    cl.add_argument("--model", choices=("small-cnn", "resnet50"), default="small-cnn", help="model to train")
    cl.add_argument("--steps", type=_positive_int, default=200, help="training steps")
    cl.add_argument("--queue-capacity", type=_positive_int, default=50, help="trainer's FIFOQueue capacity in batches")
    cl.add_argument("--seed", type=int, default=0, help="producers' seed")
    cl.add_argument("--add-host-at", type=float, default=None, metavar="S",
                    help="elastic pool: one more data host joins S seconds into training (producers run --shard auto "
                    "and the trainers find them by name); prints images/s over time and each epoch's coverage")
    cl.add_argument("--remove-host-at", type=float, default=None, metavar="S",
                    help="elastic pool: the first data host leaves S seconds into training (scaled down)")
    cl.add_argument("--no-progress", action="store_true", help="log lines instead of the trainer's progress bar")
    cl.set_defaults(func=handlers["cluster"])


def _add_status(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker status``."""
    st = sub.add_parser("status", parents=[common], formatter_class=HelpFormatter, help="live rates and queue occupancy",
                        description="Scrape the Prometheus endpoints of producers and trainers (their "
                        "--metrics-port) twice and show each one's live rate, the trainer's queue occupancy, and "
                        "which side is the bottleneck. A URL that does not answer (a producer that left the pool) is "
                        "shown as down. Exit code: 0 every URL answered; 3 some answered (shown) and the rows "
                        "marked down did not; 1 none answered; 2 bad usage.")
    st.add_argument("--metrics", required=True,
                    help="comma-separated metrics URLs, e.g. hostA:9100,hostB:9100,trainer:9200")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between the two scrapes")
    st.set_defaults(func=handlers["status"])


def _add_bench(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker bench producer|link|trainer``."""
    be = sub.add_parser("bench", parents=[common], formatter_class=HelpFormatter, help="measure one stage on its own",
                        description="Measure each stage alone, to find the bottleneck: `producer` (read, decode, "
                        "augment, serialize on one core), `link` (what arrives here from producers), `trainer` "
                        "(the step on constant input).")
    besub = be.add_subparsers(dest="bench_command", required=True, metavar="STAGE")
    bp = besub.add_parser("producer", parents=[common], formatter_class=HelpFormatter, help="producer stages, one core")
    bp.add_argument("--lmdb", required=True, help="Stoker LMDB directory")
    bp.add_argument("--image-size", type=_positive_int, default=224, help="output image size")
    bp.add_argument("--batch-size", type=_positive_int, default=64, help="batch size (serialize stage)")
    bp.add_argument("--seconds", type=float, default=2.0, help="seconds per stage")
    bp.add_argument("--pipeline", default="imagenet", metavar="NAME", help="pipeline, as for stoker produce")
    bp.add_argument("--pipeline-arg", action="append", type=_key_value, metavar="KEY=VALUE",
                    help="pipeline argument (repeatable)")
    bp.add_argument("--mode", choices=("train", "eval"), default="train", help="pipeline mode")
    bp.set_defaults(func=handlers["bench_producer"])
    bl = besub.add_parser("link", parents=[common], formatter_class=HelpFormatter, help="what arrives from producers",
                          description="Receive and validate batches from producers (no TensorFlow) and report "
                          "images/s and MB/s. Note: this takes batches a running trainer would otherwise get. Plain-mode "
                          "producers only: exact-mode ones are named and refused (exit 2).")
    bl.add_argument("--connect", required=True, help="comma-separated producer addresses")
    bl.add_argument("--seconds", type=float, default=5.0, help="measuring time after a 3-batch warm-up")
    bl.set_defaults(func=handlers["bench_link"])
    bt = besub.add_parser("trainer", parents=[common], formatter_class=HelpFormatter, help="the step on constant input")
    bt.add_argument("--model", choices=("small-cnn", "resnet50"), default="resnet50", help="model")
    bt.add_argument("--batch-size", type=_positive_int, default=64, help="batch size")
    bt.add_argument("--image-size", type=_positive_int, default=224, help="image size")
    bt.add_argument("--classes", type=_positive_int, default=1000, help="number of classes")
    bt.add_argument("--steps", type=_positive_int, default=20, help="timed steps after 3 warm-up steps")
    bt.set_defaults(func=handlers["bench_trainer"])


def _add_doctor(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker doctor``."""
    dr = sub.add_parser("doctor", parents=[common], formatter_class=HelpFormatter, help="which side limits training",
                        description="Measure what arrives from the producers and what the training step can take "
                        "on constant input, then say in one sentence which side limits training and what to do.")
    dr.add_argument("--connect", required=True, help="comma-separated producer addresses")
    dr.add_argument("--model", choices=("small-cnn", "resnet50"), default="resnet50", help="model")
    dr.add_argument("--batch-size", type=_positive_int, default=64, help="batch size the producers send")
    dr.add_argument("--image-size", type=_positive_int, default=224, help="image size the producers send")
    dr.add_argument("--classes", type=_positive_int, default=1000, help="number of classes")
    dr.add_argument("--steps", type=_positive_int, default=10, help="timed trainer steps")
    dr.add_argument("--seconds", type=float, default=5.0, help="seconds of link measurement")
    dr.add_argument("--lmdb", default=None, help="also time the producer stages on this LMDB (local copy)")
    dr.add_argument("--report", default=None, metavar="FILE.html", type=_output_file,
                    help="also train for --report-steps steps and write the bottleneck report (verdict, and over "
                    "time queue occupancy, step time, images/s per producer, producers' stage times)")
    dr.add_argument("--report-steps", type=_positive_int, default=60, help="steps of the real run for --report")
    dr.set_defaults(func=handlers["doctor"])


def _add_demo(sub: Subcommands, common: argparse.ArgumentParser, handlers: Handlers) -> None:
    """``stoker demo``."""
    d = sub.add_parser("demo", parents=[common], formatter_class=HelpFormatter, help="run the whole pipeline on this machine",
                       description="Build a small synthetic LMDB (cached), start two producer daemons on loopback "
                       "with disjoint shards, train a small CNN through ZMQInput and report images/s, queue "
                       "occupancy, the bottleneck, and a clean shutdown.")
    d.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "stoker"),
                   help="where the demo LMDB is kept between runs")
    d.add_argument("--steps", type=_positive_int, default=300, help="training steps")
    d.add_argument("--records", type=_positive_int, default=1024, help="synthetic images in the demo LMDB")
    d.add_argument("--image-size", type=_positive_int, default=64, help="image size")
    d.add_argument("--batch-size", type=_positive_int, default=32, help="batch size")
    d.add_argument("--workers", type=_positive_int, default=1, help="worker processes per producer")
    d.set_defaults(func=handlers["demo"])


def build_parser(handlers: Handlers) -> argparse.ArgumentParser:
    """The whole ``stoker`` argument parser; ``handlers`` maps each command (``"produce"``, ``"lmdb_build"``, ...)
    to the function that runs it (``args.func``)."""
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
    for add in (add_lmdb_parser, _add_produce, _add_train, add_state_parser, _add_keys, _add_cluster, _add_status, _add_bench,
                _add_doctor, _add_demo):
        add(sub, common, handlers)
    return parser
