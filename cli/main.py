"""``stoker`` command line: a thin shell over the library.

Subcommands import what they need when they run, so ``stoker produce`` and
``stoker lmdb`` work on data hosts without TensorFlow installed.
Exit codes: 0 ok, 1 runtime failure, 2 bad usage or unusable input (the
message says what to fix), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Callable, Sequence

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _setup_logging(verbose: bool, fmt: str) -> None:
    from stoker.producer.logs import configure_logging

    configure_logging(logging.DEBUG if verbose else logging.INFO, fmt)


def stop_event_on_signals() -> threading.Event:
    """An Event set by SIGTERM or SIGINT, so a long-running command can shut down cleanly."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        logging.getLogger("stoker").info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def stop_with_process(pid: int, stop: threading.Event, every_s: float = 0.5) -> threading.Thread:
    """Set ``stop`` once process ``pid`` is gone (checked every ``every_s``): a daemon started by a
    launcher that is killed outright (SIGKILL, an OOM kill) shuts down instead of serving for ever."""
    def watch() -> None:
        while not stop.wait(every_s):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                logging.getLogger("stoker").warning("process %d that started this one is gone: shutting down", pid)
                stop.set()
            except PermissionError:
                pass  # it exists, owned by another user

    thread = threading.Thread(target=watch, name="stoker-parent-watch", daemon=True)
    thread.start()
    return thread


# ---- stoker lmdb ---------------------------------------------------------------------------

def cmd_lmdb_build(args: argparse.Namespace) -> int:
    from stoker.producer.lmdb_build import build_lmdb

    report = build_lmdb(args.src, args.out, overwrite=args.overwrite, threads=args.threads, progress=not args.quiet,
                        jsonl=args.jsonl, image_fields=args.image_field or ["image"], task=args.task)
    meta = report.meta
    classes = f" in {len(meta.classes)} classes" if meta.classes else ""
    for path, reason in report.skipped:
        print(f"  skipped {path}: {reason}")
    fields = ", ".join(f"{name} ({kind})" for name, kind in meta.fields.items())
    source = "declared by the build" if report.schema_from == "declared" else f"inferred from {report.schema_from}"
    print(f"fields: {fields} ({source})")
    for warning in report.warnings:
        print(f"warning: {warning}")
    print(f"wrote {meta.count} records{classes} to {args.out}; skipped {len(report.skipped)} "
          f"{'lines' if args.jsonl else 'files'}")
    return EXIT_OK


def cmd_lmdb_synth(args: argparse.Namespace) -> int:
    from stoker.producer.synthetic import build_synthetic

    def build(out: object) -> None:
        meta = build_synthetic(out, args.count, seed=args.seed, num_classes=args.classes,  # type: ignore[arg-type]
                               overwrite=args.overwrite or args.exist_ok, progress=not args.quiet, task=args.task)
        print(f"wrote {meta.count} synthetic {args.task} records in {len(meta.classes)} classes to {args.out}")

    if not args.exist_ok:
        build(args.out)
        return EXIT_OK
    from stoker.producer.dataset_cache import cached_dataset
    from stoker.producer.dataset_format import DatasetError, LmdbDataset

    def usable(out: object) -> bool:
        try:
            with LmdbDataset(out) as ds:  # type: ignore[arg-type]
                print(f"{args.out} already holds a Stoker dataset of {len(ds)} records; leaving it")
                return True
        except DatasetError:
            return False

    # Several containers or jobs may run this at once (compose): one builds, the others wait for it.
    cached_dataset(args.out, build, usable)
    return EXIT_OK


def _describe_value(value: object) -> str:
    import numpy as np

    from stoker.producer.image_decode import DecodeError, read_image_info, sniff_format

    if isinstance(value, bytes):
        if sniff_format(value) is None:
            return f"{len(value)} bytes"
        try:  # the header only: fast, and safe against decompression bombs
            info = read_image_info(value)
            return f"{info.format} {len(value) / 1e3:.1f} KB {info.width}x{info.height}"
        except DecodeError as exc:
            return f"UNDECODABLE ({exc})"
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def cmd_lmdb_info(args: argparse.Namespace) -> int:
    from stoker.producer.dataset_format import LmdbDataset, RecordError

    with LmdbDataset(args.path) as ds:
        meta = ds.meta
        print(f"path:     {args.path}")
        print(f"format:   stoker-lmdb version {meta.version}")
        print(f"records:  {meta.count}")
        if meta.task:
            print(f"task:     {meta.task}")
        print("fields:   " + ", ".join(f"{name} ({kind})" for name, kind in meta.fields.items()))
        if meta.classes:
            print(f"classes:  {len(meta.classes)} ({', '.join(meta.classes[:8])}{', ...' if len(meta.classes) > 8 else ''})")
        print(f"size:     {ds.size_bytes() / 1e6:.1f} MB on disk")
        step = max(1, meta.count // max(1, args.samples))
        for index in range(0, meta.count, step)[: args.samples]:
            try:
                record = ds.read(index)
            except RecordError as exc:
                print(f"  {index:08d}: CORRUPT ({exc})")
                continue
            fields = []
            for name, value in record.items():
                described = _describe_value(value)
                if name == "label" and meta.classes and isinstance(value, int) and 0 <= value < len(meta.classes):
                    described += f" ({meta.classes[value]})"
                fields.append(f"{name}: {described}")
            print(f"  {index:08d}: " + ", ".join(fields))
    return EXIT_OK


# ---- stoker keys ---------------------------------------------------------------------------

def cmd_keys_generate(args: argparse.Namespace) -> int:
    from stoker.protocol.curve import generate_keypair

    public, secret = generate_keypair(args.dir, args.name)
    print(f"public key: {public}  (share it)\nsecret key: {secret}  (keep it on this host, mode 600)")
    return EXIT_OK


def _pair(args: argparse.Namespace, first: str, second: str) -> bool:
    a, b = getattr(args, first), getattr(args, second)
    if (a is None) != (b is None):
        flag = lambda name: "--" + name.replace("_", "-")
        raise ValueError(f"{flag(first)} and {flag(second)} go together: give both to enable CurveZMQ, or neither")
    return a is not None


# ---- stoker produce ------------------------------------------------------------------------

def cmd_produce(args: argparse.Namespace) -> int:
    from stoker.producer.daemon import ProducerConfig, ProducerDaemon
    from stoker.producer.sharding import ShardSpec
    from stoker.protocol.curve import load_server_keys

    curve = (load_server_keys(args.curve_secret_key, args.curve_authorized_keys)
             if _pair(args, "curve_secret_key", "curve_authorized_keys") else None)
    config = ProducerConfig(curve=curve,
        lmdb_path=args.lmdb, bind=args.bind, workers=args.workers, batch_size=args.batch_size,
        image_size=args.image_size, mode=args.mode, pipeline=args.pipeline,
        pipeline_args=tuple(args.pipeline_arg or ()), shard=ShardSpec.parse(args.shard), seed=args.seed,
        sndhwm=args.sndhwm, log_interval=args.log_interval, producer_id=args.id,
        metrics_port=args.metrics_port, log_format=getattr(args, "log_format", "text"),
        repeat_batches=args.repeat_batches,
        fast_dct=args.fast_dct, exact=args.exact, epochs=args.epochs, trainer_timeout=args.trainer_timeout,
        min_trainers=args.min_trainers,
    )
    stop = stop_event_on_signals()
    if args.parent_pid is not None:
        stop_with_process(args.parent_pid, stop)
    ProducerDaemon(config).run(stop)
    return EXIT_OK


# ---- trainer side (needs TensorFlow) -------------------------------------------------------

class MissingExtraError(RuntimeError):
    """A command needs an optional dependency that is not installed; the message names the extra."""


def _quiet_tensorflow() -> None:
    """Import TensorFlow (MissingExtraError naming the extra if it cannot be) with its C++ logging quieted."""
    # TensorFlow's C++ logging is set only by this variable; users can still override it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"this command trains or measures a model and needs TensorFlow ({exc}): install "
                                "'stoker[train]' on a GPU host or 'stoker[train-cpu]' (data hosts need neither)") from None


def cmd_train(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from stoker.consumer.training import TrainConfig, train
    from stoker.protocol.curve import load_client_keys

    curve = (load_client_keys(args.curve_secret_key, args.curve_server_key)
             if _pair(args, "curve_secret_key", "curve_server_key") else None)
    if args.receive == "direct" and (curve is not None or args.exact):
        print("stoker train: error: --receive direct works without --exact and without CurveZMQ keys; drop those or "
              "use --receive auto", file=sys.stderr)
        return EXIT_USAGE
    config = TrainConfig(curve=curve, receive=args.receive,
        addresses=[a.strip() for a in args.connect.split(",") if a.strip()], model=args.model, steps=args.steps,
        batch_size=args.batch_size, image_size=args.image_size, num_classes=args.classes,
        queue_capacity=args.queue_capacity, recv_timeout=args.recv_timeout, logdir=args.logdir,
        log_every=args.log_every, metrics_port=args.metrics_port, progress=not args.no_progress,
        exact=args.exact, trainer_id=args.trainer_id, consumed_log=args.log_consumed, report=args.report,
        discover_every=args.discover_every, share=args.share,
    )
    from stoker.consumer import InputError
    from stoker.consumer.summaries import TensorBoardNotInstalledError

    try:
        report = train(config)
    except TensorBoardNotInstalledError as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InputError as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(report.summary())
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from stoker.cli.demo import DemoConfig, run_demo

    return run_demo(DemoConfig(cache_dir=args.cache_dir, steps=args.steps, records=args.records,
                               image_size=args.image_size, batch_size=args.batch_size, workers=args.workers))


def cmd_cluster(args: argparse.Namespace) -> int:
    from stoker.cli.cluster_run import ClusterRun, run_cluster
    from stoker.cli.local_cluster import ClusterError

    run = ClusterRun(lmdb_path=args.lmdb, hosts=args.hosts, rate=args.rate, workers=args.workers,
                     batch_size=args.batch_size, image_size=args.image_size, model=args.model, steps=args.steps,
                     queue_capacity=args.queue_capacity, seed=args.seed,
                     train_args=["--no-progress"] if args.no_progress else [], trainers=args.trainers,
                     epochs=args.epochs, mode=args.mode, log_consumed=args.log_consumed,
                     add_host_at=args.add_host_at, remove_host_at=args.remove_host_at)
    try:
        return run_cluster(run)
    except ClusterError as exc:
        print(f"stoker cluster: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def cmd_bench_producer(args: argparse.Namespace) -> int:
    from stoker.producer.stage_bench import measure_stages

    rates = measure_stages(args.lmdb, image_size=args.image_size, batch_size=args.batch_size, seconds=args.seconds,
                           pipeline=args.pipeline, pipeline_args=dict(args.pipeline_arg or ()), mode=args.mode)
    print(rates.table())
    return EXIT_OK


def cmd_bench_link(args: argparse.Namespace) -> int:
    from stoker.consumer.throughput import measure_link

    rate = measure_link(_addresses(args.connect), seconds=args.seconds)
    print(f"arriving: {rate.images_per_s:.0f} images/s, {rate.mb_per_s:.0f} MB/s over {rate.batches} batches "
          f"({', '.join(f'{p}: {n}' for p, n in sorted(rate.per_producer.items()))})")
    return EXIT_OK


def cmd_bench_trainer(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from stoker.consumer.throughput import measure_constant_step

    rate = measure_constant_step(args.model, args.batch_size, args.image_size, args.classes, steps=args.steps)
    print(f"{args.model} on constant input: {rate:.0f} images/s ({rate / args.batch_size:.2f} steps/s, "
          f"batch {args.batch_size} x {args.image_size}px)")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from stoker.consumer.throughput import Diagnosis, measure_constant_step, measure_link

    link = measure_link(_addresses(args.connect), seconds=args.seconds)
    print(f"input:   {link.images_per_s:.0f} images/s arriving ({link.mb_per_s:.0f} MB/s) from "
          f"{len(link.per_producer)} producer(s)")
    train = measure_constant_step(args.model, args.batch_size, args.image_size, args.classes, steps=args.steps)
    print(f"trainer: {train:.0f} images/s on constant input ({args.model})")
    pipeline = None
    if args.lmdb:
        from stoker.producer.stage_bench import measure_stages

        rates = measure_stages(args.lmdb, image_size=args.image_size, batch_size=args.batch_size)
        print(rates.table())
        pipeline = rates.pipeline
    verdict = Diagnosis(link.images_per_s, train, link.mb_per_s, len(link.per_producer), pipeline).sentence()
    print("verdict: " + verdict)
    if args.report:
        from stoker.consumer.report import write_report
        from stoker.consumer.training import TrainConfig, train as run_training

        from stoker.consumer import InputError

        print(f"a real run of {args.report_steps} steps for the report ...", flush=True)
        try:
            run = run_training(TrainConfig(addresses=_addresses(args.connect), model=args.model,
                                           steps=args.report_steps, batch_size=args.batch_size,
                                           image_size=args.image_size, num_classes=args.classes, progress=False,
                                           timeline=True, warmup_steps=min(10, args.report_steps // 2)))
        except InputError as exc:
            print(f"stoker doctor: error: the run for the report failed: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        facts = {"input arriving (bare receive)": f"{link.images_per_s:.0f} images/s, {link.mb_per_s:.0f} MB/s",
                 "trainer on constant input": f"{train:.0f} images/s ({args.model})", **run.facts()}
        if pipeline:
            facts["one producer worker (this host, stage bench)"] = f"{pipeline:.0f} images/s"
        write_report(args.report, f"stoker doctor: {args.model}", f"{verdict} During the run: {run.bottleneck()}.",
                     run.timeline, facts)  # type: ignore[arg-type]
        print(f"wrote the report to {args.report}")
    return EXIT_OK


def _share(text: str) -> tuple[int, int]:
    try:
        rank, world = (int(x) for x in text.split("/"))
        if 0 <= rank < world:
            return rank, world
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK/WORLD with 0 <= RANK < WORLD, e.g. 0/2, got {text!r}")


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def cmd_status(args: argparse.Namespace) -> int:
    from stoker.cli.status import ScrapeError, print_status

    try:
        print_status([u.strip() for u in args.metrics.split(",") if u.strip()], args.interval)
    except ScrapeError as exc:
        print(f"stoker status: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="Stoker keeps accelerators fed: producer daemons on CPU hosts decode and augment images from an "
        "LMDB and push uint8 batches over ZeroMQ to a TensorFlow trainer (ZMQInput -> FIFOQueue -> StagingArea).",
        formatter_class=_Formatter,
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

    lmdb = sub.add_parser("lmdb", parents=[common], help="build and inspect Stoker LMDB datasets", formatter_class=_Formatter,
                          description="Build and inspect datasets in the Stoker LMDB format (docs/format.md).")
    lsub = lmdb.add_subparsers(dest="lmdb_command", required=True, metavar="ACTION")
    b = lsub.add_parser("build", parents=[common], formatter_class=_Formatter, help="build an LMDB from an image folder or list file",
                        description="Build an LMDB from SRC: a folder with one sub-folder per class (ImageNet train "
                        "layout) or a list file of `path label` lines. Images are recognised by content (JPEG, PNG, "
                        "WebP, BMP, GIF, TIFF) and stored as they are, after a check with the producers' decoder. "
                        "Every file not stored (not an image, over 8192x8192 pixels, corrupt, unreadable, outside a "
                        "class folder) is listed by path with the reason, and counted. The result appears at OUT "
                        "only when complete.")
    b.add_argument("src", help="image folder (SRC/<class>/<files>), list file, or with --jsonl a JSON-lines file")
    b.add_argument("out", help="output LMDB directory")
    b.add_argument("--jsonl", action="store_true",
                   help="SRC is JSON lines: one object per line, image fields holding paths relative to SRC's folder, "
                   "other fields stored as their JSON values (e.g. {\"image\": \"a.jpg\", \"boxes\": [[x1, y1, "
                   "x2, y2]], \"classes\": [3]})")
    b.add_argument("--image-field", action="append", metavar="NAME",
                   help="with --jsonl: a field holding an image path (repeatable; default: image)")
    b.add_argument("--task", default="", help="task name stored in the metadata (e.g. detection)")
    b.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    b.add_argument("--threads", type=_positive_int, default=None, help="threads that verify images (default: CPU count)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_lmdb_build)
    s = lsub.add_parser("synth", parents=[common], formatter_class=_Formatter, help="make a deterministic synthetic JPEG dataset",
                        description="Write COUNT photo-like synthetic records (JPEGs of 300-500 px) for demos, tests "
                        "and benchmarks, for a classification, detection or segmentation task. Same --seed, same bytes.")
    s.add_argument("out", help="output LMDB directory")
    s.add_argument("--count", type=_positive_int, default=1000, help="number of images")
    s.add_argument("--seed", type=int, default=0, help="generator seed")
    s.add_argument("--classes", type=_positive_int, default=10, help="number of classes")
    s.add_argument("--task", choices=("classification", "detection", "segmentation"), default="classification",
                   help="classification: image + label; detection: image + boxes + classes of the drawn objects; "
                   "segmentation: image + a PNG mask of the drawn shapes")
    s.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    s.add_argument("--exist-ok", action="store_true", help="do nothing if OUT already holds a Stoker dataset")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_lmdb_synth)
    i = lsub.add_parser("info", parents=[common], formatter_class=_Formatter, help="describe an LMDB",
                        description="Print record count, classes, format version, size and a few sample records.")
    i.add_argument("path", help="LMDB directory")
    i.add_argument("--samples", type=int, default=5, help="sample records to show")
    i.set_defaults(func=cmd_lmdb_info)

    p = sub.add_parser("produce", parents=[common], formatter_class=_Formatter, help="run a producer daemon",
                       description="Serve batches made by a pipeline from an LMDB on a ZMQ PUSH socket until "
                       "SIGTERM/SIGINT. The default imagenet pipeline sends images uint8 [B,H,W,3] RGB and labels "
                       "int32 [B]; every batch also carries index int64 [B] and epoch int32 [B] (which record, which "
                       "epoch). Pipelines: imagenet, detection, segmentation, or your own "
                       "(--pipeline my_module:make_pipeline or path/to/file.py:make_pipeline).")
    p.add_argument("--lmdb", required=True, help="Stoker LMDB directory")
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
                   "leave a running job (implies --exact; every producer of a pool needs the same --seed, default 0)")
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
    p.add_argument("--seed", type=int, default=None, help="seed for epoch order and augmentation (default: random, logged)")
    p.add_argument("--sndhwm", type=_positive_int, default=2,
                   help="batches queued on the trainer-facing socket before backpressure; each worker decodes into "
                   "SNDHWM+1 shared-memory batch slots, so memory ~ workers x (SNDHWM+1) x batch bytes")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between rate log lines")
    p.add_argument("--id", default=None, help="producer id in headers (default: HOST:PORT#SHARD)")
    p.add_argument("--parent-pid", type=_positive_int, default=None, metavar="PID",
                   help="shut down when process PID exits (for launchers: a test run or a harness killed outright "
                   "leaves no producer behind); none: run until SIGTERM/SIGINT")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (none: off)")
    p.add_argument("--repeat-batches", type=int, default=0, metavar="K",
                   help="benchmarking only: each worker makes K real batches, then re-sends them as fast as the "
                   "network takes them (isolates transport and trainer from decoding); 0: off")
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this producer's NAME.key_secret: enables CurveZMQ encryption (with --curve-authorized-keys)")
    p.add_argument("--curve-authorized-keys", default=None, metavar="DIR",
                   help="folder of trainer public keys (*.key) allowed to connect")
    p.set_defaults(func=cmd_produce)

    t = sub.add_parser("train", parents=[common], formatter_class=_Formatter, help="train a Keras model fed by producers",
                       description="Train a Keras model on batches from producer daemons through ZMQInput, with a "
                       "progress bar showing images/s and queue occupancy and TensorBoard summaries in --logdir.")
    t.add_argument("--connect", required=True,
                   help="comma-separated producer addresses, e.g. tcp://hostA:5555,tcp://hostB:5555; a host name "
                   "stands for every address it resolves to, re-resolved every --discover-every s (a Kubernetes "
                   "headless Service: tcp://stoker-producer.NAMESPACE.svc:5555 follows kubectl scale)")
    t.add_argument("--discover-every", type=float, default=5.0, metavar="S",
                   help="seconds between re-resolving producer names (0: resolve once)")
    t.add_argument("--share", type=_share, default=(0, 1), metavar="RANK/WORLD",
                   help="exact mode with an elastic pool (producers --shard auto): this trainer's share of each "
                   "epoch's splits, for data-parallel trainers")
    t.add_argument("--model", choices=("small-cnn", "resnet50"), default="small-cnn", help="model to train")
    t.add_argument("--steps", type=_positive_int, default=1000, help="training steps")
    t.add_argument("--batch-size", type=_positive_int, default=64, help="batch size the producers send")
    t.add_argument("--image-size", type=_positive_int, default=224, help="image size the producers send")
    t.add_argument("--classes", type=_positive_int, default=1000, help="number of classes (labels must be below it)")
    t.add_argument("--queue-capacity", type=_positive_int, default=50, help="FIFOQueue capacity in batches")
    t.add_argument("--recv-timeout", type=float, default=60.0, help="seconds without any batch before training fails")
    t.add_argument("--logdir", default=None, help="TensorBoard log directory (none: no summaries)")
    t.add_argument("--log-every", type=_positive_int, default=50, help="steps between occupancy log lines/summaries")
    t.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (none: off)")
    t.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    t.add_argument("--exact", action="store_true",
                   help="exact epochs (producers run --exact or --epochs N); training ends early when a finite run "
                   "of the producers does")
    t.add_argument("--trainer-id", default=None, type=_trainer_id, help="exact mode: this trainer's id for the producers (default: random)")
    t.add_argument("--receive", choices=("auto", "direct", "libzmq"), default="auto",
                   help="how batches are received (default auto: direct where it applies, else libzmq). direct: each "
                   "producer's stream read over ZMTP straight into memory TensorFlow owns, one copy less per byte "
                   "and every message bounded (tcp:// addresses; not with --exact or CurveZMQ keys); libzmq: "
                   "through libzmq (CurveZMQ, ipc://, exact mode)")
    t.add_argument("--log-consumed", default=None, metavar="FILE", type=_output_file,
                   help="write each step's record indices and epochs as JSON lines, to verify coverage")
    t.add_argument("--report", default=None, metavar="FILE.html", type=_output_file,
                   help="at the end, write the bottleneck report: the verdict and, over time, queue occupancy, step "
                   "time, images/s per producer and producers' stage times (one self-contained HTML file)")
    t.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this trainer's NAME.key_secret: enables CurveZMQ (with --curve-server-key)")
    t.add_argument("--curve-server-key", default=None, metavar="FILE", help="the producers' public NAME.key")
    t.set_defaults(func=cmd_train)

    k = sub.add_parser("keys", parents=[common], formatter_class=_Formatter, help="make CurveZMQ key pairs",
                       description="CurveZMQ keys encrypt batches and let producers accept only known trainers. "
                       "Producers: --curve-secret-key server.key_secret --curve-authorized-keys DIR_OF_CLIENT_KEYS. "
                       "Trainers: --curve-secret-key client.key_secret --curve-server-key server.key.")
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kg = ksub.add_parser("generate", parents=[common], formatter_class=_Formatter, help="write NAME.key and NAME.key_secret",
                         description="Write a key pair: DIR/NAME.key (public, share it) and DIR/NAME.key_secret "
                         "(secret, mode 600).")
    kg.add_argument("dir", help="folder to write the key files into")
    kg.add_argument("--name", default="stoker", help="file name stem")
    kg.set_defaults(func=cmd_keys_generate)

    cl = sub.add_parser("cluster", parents=[common], formatter_class=_Formatter,
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
    cl.set_defaults(func=cmd_cluster)

    st = sub.add_parser("status", parents=[common], formatter_class=_Formatter, help="live rates and queue occupancy",
                        description="Scrape the Prometheus endpoints of producers and trainers (their "
                        "--metrics-port) twice and show each one's live rate, the trainer's queue occupancy, and "
                        "which side is the bottleneck.")
    st.add_argument("--metrics", required=True,
                    help="comma-separated metrics URLs, e.g. hostA:9100,hostB:9100,trainer:9200")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between the two scrapes")
    st.set_defaults(func=cmd_status)

    be = sub.add_parser("bench", parents=[common], formatter_class=_Formatter, help="measure one stage on its own",
                        description="Measure each stage alone, to find the bottleneck: `producer` (read, decode, "
                        "augment, serialize on one core), `link` (what arrives here from producers), `trainer` "
                        "(the step on constant input).")
    besub = be.add_subparsers(dest="bench_command", required=True, metavar="STAGE")
    bp = besub.add_parser("producer", parents=[common], formatter_class=_Formatter, help="producer stages, one core")
    bp.add_argument("--lmdb", required=True, help="Stoker LMDB directory")
    bp.add_argument("--image-size", type=_positive_int, default=224, help="output image size")
    bp.add_argument("--batch-size", type=_positive_int, default=64, help="batch size (serialize stage)")
    bp.add_argument("--seconds", type=float, default=2.0, help="seconds per stage")
    bp.add_argument("--pipeline", default="imagenet", metavar="NAME", help="pipeline, as for stoker produce")
    bp.add_argument("--pipeline-arg", action="append", type=_key_value, metavar="KEY=VALUE",
                    help="pipeline argument (repeatable)")
    bp.add_argument("--mode", choices=("train", "eval"), default="train", help="pipeline mode")
    bp.set_defaults(func=cmd_bench_producer)
    bl = besub.add_parser("link", parents=[common], formatter_class=_Formatter, help="what arrives from producers",
                          description="Receive and validate batches from producers (no TensorFlow) and report "
                          "images/s and MB/s. Note: this takes batches a running trainer would otherwise get.")
    bl.add_argument("--connect", required=True, help="comma-separated producer addresses")
    bl.add_argument("--seconds", type=float, default=5.0, help="measuring time after a 3-batch warm-up")
    bl.set_defaults(func=cmd_bench_link)
    bt = besub.add_parser("trainer", parents=[common], formatter_class=_Formatter, help="the step on constant input")
    bt.add_argument("--model", choices=("small-cnn", "resnet50"), default="resnet50", help="model")
    bt.add_argument("--batch-size", type=_positive_int, default=64, help="batch size")
    bt.add_argument("--image-size", type=_positive_int, default=224, help="image size")
    bt.add_argument("--classes", type=_positive_int, default=1000, help="number of classes")
    bt.add_argument("--steps", type=_positive_int, default=20, help="timed steps after 3 warm-up steps")
    bt.set_defaults(func=cmd_bench_trainer)

    dr = sub.add_parser("doctor", parents=[common], formatter_class=_Formatter, help="which side limits training",
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
    dr.set_defaults(func=cmd_doctor)

    d = sub.add_parser("demo", parents=[common], formatter_class=_Formatter, help="run the whole pipeline on this machine",
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
    d.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose, args.log_format)
    from stoker.producer.daemon import BindError
    from stoker.producer.dataset_format import DatasetError
    from stoker.producer.lmdb_build import SourceError

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
