"""``stoker produce``'s flags: the daemon's settings (``ProducerConfig``), every default and help text.

``add_produce_parser`` adds the subcommand; ``cli/produce/command.py`` runs it.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from stoker.cli.argument_parser import HelpFormatter, key_value, output_file, positive_int, size_argument
from stoker.cli.lmdb.storage_flags import add_storage_arguments
from stoker.cli.produce.command import cmd_produce

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _add_dataset_source(p: argparse.ArgumentParser) -> None:
    """``stoker produce``'s dataset: where it is, and how shards from object storage are cached and ordered."""
    p.add_argument("--data", "--lmdb", dest="lmdb", required=True, metavar="LOCATION",
                   help="the dataset (--lmdb is its old name, still read): an LMDB folder; a folder or object-storage "
                   "prefix holding a sharded dataset's manifest.json (s3://bucket/prefix, any fsspec URL; shards "
                   "fetched into --cache-dir as they are needed); or an index of WebDataset tars or Parquet files, "
                   "a path or URL ending in .json (`stoker data index`), read where its root says they are")
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
    p.add_argument("--epoch-order", choices=("auto", "1", "2"), default="auto",
                   help="the epoch order (docs/protocol.md): 1 materialises a permutation of every "
                   "record (datasets up to 10^8 records; what every Stoker before order 2 served, so their "
                   "checkpoints resume), 2 computes just the positions at hand and keeps trainers' state as ranges "
                   "(any size to 2^40 records; trainers need Stoker with order 2; a fixed shard --shard I/N orders its "
                   "own records, at most 10^8 of them, and is in order 2 only when asked). auto: 2 for an elastic "
                   "pool beyond 10^8 records, else 1. The same on every producer of a job")
    p.add_argument("--shard-affinity", choices=("on", "off"), default="on",
                   help="--shard auto from object storage: tell the trainers which shards this host's cache holds, "
                   "so they hand it the splits of those shards and each host fetches mostly its own (default on); "
                   "off: they hand it any split (the baseline of benchmarks/shard_fetches.py)")


def add_produce_parser(sub: "Subcommands", common: argparse.ArgumentParser) -> None:
    """``stoker produce``: the daemon's flags (``ProducerConfig``)."""
    p = sub.add_parser("produce", parents=[common], formatter_class=HelpFormatter, help="run a producer daemon",
                       description="Serve batches made by a pipeline from an LMDB on a ZMQ PUSH socket until "
                       "SIGTERM/SIGINT. The default imagenet pipeline sends images uint8 [B,H,W,3] RGB and labels "
                       "int32 [B]; every batch also carries index int64 [B] and epoch int32 [B] (which record, which "
                       "epoch). Pipelines: imagenet, detection, segmentation, image_text (an image and its caption), "
                       "or your own (--pipeline my_module:make_pipeline or path/to/file.py:make_pipeline).")
    _add_dataset_source(p)
    add_storage_arguments(p)
    p.add_argument("--bind", default="tcp://*:5555", help="ZMQ address to bind; trainers connect to it")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="decode/augment processes")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per batch")
    p.add_argument("--image-size", type=positive_int, default=224,
                   help="output height and width in pixels, for pipelines that take image_size (the built-ins; "
                   "--pipeline-arg size=HxW for non-square)")
    p.add_argument("--mode", choices=("train", "eval"), default="train",
                   help="train: random augmentation (imagenet: random-resized-crop + flip); eval: deterministic "
                   "(imagenet: resize + centre crop); passed to pipelines that take mode")
    p.add_argument("--pipeline", default="imagenet", metavar="NAME",
                   help="imagenet, detection, segmentation, image_text, package.module:function or "
                   "path/file.py:function (a function returning a stoker.producer.pipeline.Pipeline; see README)")
    p.add_argument("--pipeline-arg", action="append", type=key_value, metavar="KEY=VALUE",
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
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="serve exactly this many epochs, then stop (implies --exact); none: endless")
    p.add_argument("--min-trainers", type=positive_int, default=1,
                   help="exact mode: serve nothing until this many trainers joined, so in a synchronous "
                   "data-parallel job no trainer starts ahead of the others")
    p.add_argument("--trainer-timeout", type=float, default=10.0,
                   help="exact mode: seconds without a message before a trainer is taken for dead and the records "
                   "it held are served again")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for epoch order and augmentation (default: random, logged; with --shard auto: 0)")
    p.add_argument("--sndhwm", type=positive_int, default=2,
                   help="batches queued on the trainer-facing socket before backpressure; each worker decodes into "
                   "SNDHWM+1 shared-memory batch slots, so memory ~ workers x (SNDHWM+1) x batch bytes")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between rate log lines")
    p.add_argument("--id", default=None,
                   help="producer id in headers (default: HOST:PORT#SHARD~INSTANCE, INSTANCE 6 random hex digits, "
                   "so every daemon, a restarted one too, is its own entry in a trainer's stats)")
    p.add_argument("--parent-pid", type=positive_int, default=None, metavar="PID",
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
    p.add_argument("--status-file", default=None, metavar="FILE", type=output_file,
                   help="for launchers: write JSON lines made for programs to FILE (truncated at start), one when "
                   "serving (endpoint, producer id, pid, mode) and one at the stop (batches, images, records skipped); "
                   "read it, not the log, whose wording may change; none: no file")
    p.set_defaults(func=cmd_produce)
