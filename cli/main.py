"""``stoker`` command line: a thin shell over the library.

Subcommands import what they need when they run, so ``stoker produce`` and
``stoker lmdb`` work on data hosts without TensorFlow installed.
Exit codes (``cli/exit_codes.py``): 0 ok, 1 runtime failure, 2 bad usage or unusable
input (the message says what to fix), 3 (``stoker status``) some metrics URLs down, 130 interrupted.
The flags live in ``cli/parser.py``, the ``stoker lmdb`` commands in ``cli/lmdb_commands.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from stoker.cli.exit_codes import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_DOWN, EXIT_USAGE
from stoker.cli.lmdb_commands import cmd_lmdb_build, cmd_lmdb_info, cmd_lmdb_synth, cmd_lmdb_upload, storage_of
from stoker.cli.state_commands import cmd_state_info, cmd_state_merge
from stoker.cli.parser import build_parser as parser_for

if TYPE_CHECKING:
    from stoker.consumer.train.throughput import LinkRate


def _setup_logging(verbose: bool, fmt: str) -> None:
    from stoker.producer.serve.logs import configure_logging

    configure_logging(logging.DEBUG if verbose else logging.INFO, fmt)


def stop_event_on_signals() -> threading.Event:
    """An Event set by SIGTERM or SIGINT, so a long-running command can shut down cleanly (every wait of it,
    storage's retries included, watches the event). A second signal raises KeyboardInterrupt: a person who asks
    twice is not kept waiting by anything that missed the first."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            logging.getLogger("stoker").warning("received %s again: stopping now", name)
            raise KeyboardInterrupt(name)
        logging.getLogger("stoker").info("received %s, shutting down", name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def stop_with_process(pid: int, stop: threading.Event, every_s: float = 0.5) -> threading.Thread:
    """Set ``stop`` once process ``pid`` is gone (checked every ``every_s``): a daemon started by a
    launcher that is killed outright (SIGKILL, an OOM kill) shuts down instead of serving for ever."""
    from stoker.producer.measure.procfs import running

    def watch() -> None:
        while not stop.wait(every_s):
            if not running(pid):  # gone, or a zombie: killed and not yet reaped by its own parent
                logging.getLogger("stoker").warning("process %d that started this one is gone: shutting down", pid)
                stop.set()

    thread = threading.Thread(target=watch, name="stoker-parent-watch", daemon=True)
    thread.start()
    return thread


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
    from stoker.producer.serve.daemon import ProducerConfig, ProducerDaemon
    from stoker.producer.serve.sharding import ShardSpec
    from stoker.protocol.curve import load_server_keys

    curve = (load_server_keys(args.curve_secret_key, args.curve_authorized_keys)
             if _pair(args, "curve_secret_key", "curve_authorized_keys") else None)
    config = ProducerConfig(curve=curve,
        lmdb_path=args.lmdb, bind=args.bind, workers=args.workers, batch_size=args.batch_size,
        image_size=args.image_size, mode=args.mode, pipeline=args.pipeline,
        pipeline_args=tuple(args.pipeline_arg or ()), shard=ShardSpec.parse(args.shard), seed=args.seed,
        shuffle_window=args.shuffle_window, shard_affinity=args.shard_affinity == "on",
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
    from stoker.consumer.train.loop import TrainConfig, train
    from stoker.protocol.curve import load_client_keys

    curve = (load_client_keys(args.curve_secret_key, args.curve_server_key)
             if _pair(args, "curve_secret_key", "curve_server_key") else None)
    if args.receive == "direct" and curve is not None:
        print("stoker train: error: --receive direct works without CurveZMQ keys; drop those or use --receive auto",
              file=sys.stderr)
        return EXIT_USAGE
    from stoker.consumer.receive.options import check_source

    try:
        addresses = check_source(_addresses(args.connect))
    except ValueError as exc:
        print(f"stoker train: error: --connect: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = TrainConfig(curve=curve, receive=args.receive,
        addresses=list(addresses), model=args.model, steps=args.steps,
        batch_size=args.batch_size, image_size=args.image_size, num_classes=args.classes,
        queue_capacity=args.queue_capacity, recv_timeout=args.recv_timeout, logdir=args.logdir,
        log_every=args.log_every, metrics_port=args.metrics_port, progress=not args.no_progress,
        exact=args.exact, trainer_id=args.trainer_id, consumed_log=args.log_consumed, report=args.report,
        discover_every=args.discover_every, share=args.share, stall_after=args.stall_after,
        stall_limit=args.stall_limit, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0,
        resume=args.resume,
    )
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        print("stoker train: error: --resume and --checkpoint-every need --checkpoint-dir DIR", file=sys.stderr)
        return EXIT_USAGE
    from stoker.consumer import InputError, InputMismatchError
    from stoker.consumer.tf.summaries import TensorBoardNotInstalledError
    from stoker.consumer.train.checkpoints import CheckpointMismatchError
    from stoker.consumer.train.loop import TrainingInterrupted
    from stoker.consumer.train.models import ClassCountError

    try:
        report = train(config)
    except (TensorBoardNotInstalledError, InputMismatchError, ClassCountError, CheckpointMismatchError) as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)  # a flag to change, named
        return EXIT_USAGE
    except InputError as exc:
        print(f"stoker train: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except TrainingInterrupted as exc:  # after a whole step: what it measured, as at the end
        print("\n".join([exc.report.summary(), *exc.report.written()]))
        print("stoker train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print("\n".join([report.summary(), *report.written()]))
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
                     no_progress=args.no_progress, trainers=args.trainers,
                     epochs=args.epochs, mode=args.mode, log_consumed=args.log_consumed,
                     add_host_at=args.add_host_at, remove_host_at=args.remove_host_at)
    try:
        return run_cluster(run)
    except ClusterError as exc:
        print(f"stoker cluster: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def cmd_bench_producer(args: argparse.Namespace) -> int:
    from stoker.producer.measure.stage_bench import measure_stages

    rates = measure_stages(args.lmdb, image_size=args.image_size, batch_size=args.batch_size, seconds=args.seconds,
                           pipeline=args.pipeline, pipeline_args=dict(args.pipeline_arg or ()), mode=args.mode)
    print(rates.table())
    return EXIT_OK


def _measure_link(args: argparse.Namespace, command: str) -> "LinkRate | int":
    """``measure_link`` for ``stoker bench link`` and ``doctor``; on the input's error, print it (with what to do
    instead when the producers run exact mode) and return the exit code."""
    from stoker.consumer.receive.errors import InputError, InputMismatchError, InputModeError
    from stoker.consumer.train.throughput import measure_link

    try:
        return measure_link(_addresses(args.connect), seconds=args.seconds)
    except InputModeError as exc:
        # Receiving in exact mode would take records from the job the producers serve: say so rather than do it.
        print(f"stoker {command}: error: {exc}. stoker {command} receives as a plain-mode trainer and does "
              "not join an exact-mode job (its batches would be counted as consumed and lost to the job's "
              "trainers): point it at producers started without --exact, or measure the job itself with "
              "`stoker train --exact --report FILE`", file=sys.stderr)
        return EXIT_USAGE
    except InputMismatchError as exc:
        print(f"stoker {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except InputError as exc:
        print(f"stoker {command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def cmd_bench_link(args: argparse.Namespace) -> int:
    rate = _measure_link(args, "bench link")
    if isinstance(rate, int):
        return rate
    print(f"arriving: {rate.images_per_s:.0f} images/s, {rate.mb_per_s:.0f} MB/s over {rate.batches} batches "
          f"({', '.join(f'{p}: {n}' for p, n in sorted(rate.per_producer.items()))})")
    return EXIT_OK


def cmd_bench_trainer(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from stoker.consumer.train.throughput import measure_constant_step

    rate = measure_constant_step(args.model, args.batch_size, args.image_size, args.classes, steps=args.steps)
    print(f"{args.model} on constant input: {rate:.0f} images/s ({rate / args.batch_size:.2f} steps/s, "
          f"batch {args.batch_size} x {args.image_size}px)")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from stoker.consumer.train.throughput import Diagnosis, measure_constant_step, training_device

    link = _measure_link(args, "doctor")
    if isinstance(link, int):
        return link
    print(f"input:   {link.images_per_s:.0f} images/s arriving ({link.mb_per_s:.0f} MB/s) from "
          f"{len(link.per_producer)} producer(s)")
    train = measure_constant_step(args.model, args.batch_size, args.image_size, args.classes, steps=args.steps)
    device = training_device()
    print(f"trainer: {train:.0f} images/s on constant input ({args.model}, on the {device})")
    pipeline = None
    if args.lmdb:
        from stoker.producer.measure.stage_bench import measure_stages

        rates = measure_stages(args.lmdb, image_size=args.image_size, batch_size=args.batch_size)
        print(rates.table())
        pipeline = rates.pipeline
    verdict = Diagnosis(link.images_per_s, train, link.mb_per_s, len(link.per_producer), pipeline, device).sentence()
    print("verdict: " + verdict)
    if args.report:
        from stoker.consumer.train.report import write_report
        from stoker.consumer.train.loop import TrainConfig, train as run_training

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
                 "trainer on constant input": f"{train:.0f} images/s ({args.model}, on the {device})", **run.facts()}
        if pipeline:
            facts["one producer worker (this host, stage bench)"] = f"{pipeline:.0f} images/s"
        write_report(args.report, f"stoker doctor: {args.model}", f"{verdict} During the run: {run.bottleneck()}.",
                     run.timeline, facts)  # type: ignore[arg-type]
        print(f"wrote the report to {args.report}")
    return EXIT_OK


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def cmd_status(args: argparse.Namespace) -> int:
    from stoker.cli.status import ScrapeError, print_status

    try:
        rows = print_status([u.strip() for u in args.metrics.split(",") if u.strip()], args.interval)
    except ScrapeError as exc:
        print(f"stoker status: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_SOME_DOWN if any(r.kind == "down" for r in rows) else EXIT_OK


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "lmdb_build": cmd_lmdb_build,
    "lmdb_synth": cmd_lmdb_synth,
    "lmdb_info": cmd_lmdb_info,
    "produce": cmd_produce,
    "train": cmd_train,
    "keys_generate": cmd_keys_generate,
    "lmdb_upload": cmd_lmdb_upload,
    "state_info": cmd_state_info,
    "state_merge": cmd_state_merge,
    "cluster": cmd_cluster,
    "status": cmd_status,
    "bench_producer": cmd_bench_producer,
    "bench_link": cmd_bench_link,
    "bench_trainer": cmd_bench_trainer,
    "doctor": cmd_doctor,
    "demo": cmd_demo,
}


def build_parser() -> argparse.ArgumentParser:
    return parser_for(HANDLERS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
