"""``stoker bench producer|link|trainer`` and ``stoker doctor``: each stage measured on its own, and which side
limits training.

The flags are in ``cli/measure/flags.py``. ``bench link`` and ``doctor`` receive as a plain-mode trainer: producers
in exact mode are named and refused (exit 2), since receiving would take records from their job.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from stoker.cli.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from stoker.cli.optional_extras import quiet_tensorflow
from stoker.cli.train.command import connect_addresses

if TYPE_CHECKING:
    from stoker.consumer.train.throughput import LinkRate


def cmd_bench_producer(args: argparse.Namespace) -> int:
    from stoker.producer.measure.stage_bench import measure_stages

    rates = measure_stages(args.lmdb, image_size=args.image_size, batch_size=args.batch_size, seconds=args.seconds,
                           pipeline=args.pipeline, pipeline_args=dict(args.pipeline_arg or ()), mode=args.mode)
    print(rates.table())
    return EXIT_OK


def cmd_bench_pool(args: argparse.Namespace) -> int:
    """One core's rate on the user's pipeline and data, then the plan for ``--demand`` (``pool_plan.py``)."""
    import json

    from stoker.cli.measure.pool_plan import plan_pool
    from stoker.producer.measure.stage_bench import measure_stages

    rates = measure_stages(args.lmdb, image_size=args.image_size, batch_size=args.batch_size, seconds=args.seconds,
                           pipeline=args.pipeline, pipeline_args=dict(args.pipeline_arg or ()), mode=args.mode)
    try:
        plan = plan_pool(rates.pipeline, args.demand, args.cores_per_host, args.headroom, args.workers_per_host,
                         rates.sample_bytes)
    except ValueError as exc:
        print(f"stoker bench pool: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({**plan.as_dict(), "stages": rates.as_dict()}))
    else:
        print(rates.table())
        print()
        print(plan.table())
    return EXIT_OK


def _measure_link(args: argparse.Namespace, command: str) -> "LinkRate | int":
    """``measure_link`` for ``stoker bench link`` and ``doctor``; on the input's error, print it (with what to do
    instead when the producers run exact mode) and return the exit code."""
    from stoker.consumer.receive.errors import InputError, InputMismatchError, InputModeError
    from stoker.consumer.train.throughput import measure_link

    try:
        return measure_link(connect_addresses(args.connect), seconds=args.seconds)
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
    quiet_tensorflow()
    from stoker.consumer.train.throughput import measure_constant_step

    rate = measure_constant_step(args.model, args.batch_size, args.image_size, args.classes, steps=args.steps)
    print(f"{args.model} on constant input: {rate:.0f} images/s ({rate / args.batch_size:.2f} steps/s, "
          f"batch {args.batch_size} x {args.image_size}px)")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    quiet_tensorflow()
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
            run = run_training(TrainConfig(addresses=connect_addresses(args.connect), model=args.model,
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
