"""A producer on the trainer's host (issue 43, ``local_producer=``): the images/s it adds, the step time it costs.

The trainer is modelled: this process pinned to core 0 (its receive threads too), a step of a fixed amount of
CPU work, ``--busy-ms`` when calibrated alone (the host's part of a step: the framework's dispatch, the loss),
then ``--sleep-ms`` asleep (the accelerator's part). The remote producer is another process, throttled to a fixed supply below the step's
demand (paused and resumed in turn: on a 2-core host a remote producer adds no CPU) and pinned to core 1. Each
round opens a ``BatchStream`` without, then with, a local producer of one worker pinned to core 1 at nice +10
(``LocalProducer(cpus=[1])``), rounds interleaved, and times ``--seconds`` of steps after the first batch of
every producer it reads: images/s taken, images/s the local producer sent, and the mean step time (busy +
sleep, the waits for input excluded). The figure is the step time with / without, per pair of rounds.

    python benchmarks/local_producer.py --rounds 3

On the shared 2-core development host (docs/performance.md, "Right-sizing (issue 43)"): others' work shares
both cores, so the spread between pairs is stated with the median.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from harness import add_out_argument, benchmark_parser, launch_producer, machine_info, own_cpu_seconds, \
    producer_flags, synthetic_lmdb, write_results

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.placement.local_producer import LocalProducer
from stoker.producer.throttle import Throttle


def work(loops: int) -> int:
    """A fixed amount of CPU work (the host's part of a step): it takes longer when the core is shared."""
    total = 0
    for i in range(loops):
        total += i * i
    return total


def loops_for(seconds: float) -> int:
    """Loops of ``work`` that take ``seconds`` on this core now (the best of 5 tries: least disturbed)."""
    t = min(_timed(100_000) for _ in range(5))
    return max(1, int(100_000 * seconds / t))


def _timed(loops: int) -> float:
    t = time.perf_counter()
    work(loops)
    return time.perf_counter() - t


def one_round(remote: str, local: LocalProducer | None, seconds: float, loops: int, work_s: float, sleep_s: float,
              batch: int) -> dict[str, Any]:
    """One timed round: steps over ``seconds`` after a batch of every producer came; what it measured. The
    trainer's CPU a step less ``work_s`` (the step's own work, as calibrated) is what receiving cost it."""
    with BatchStream([remote], local_producer=local, recv_timeout=60) as stream:
        wanted = 2 if local is not None else 1
        while len(stream.stats.per_producer) < wanted:  # warm-up: each producer serving
            next(stream)
        local_id = stream.local_producer.producer_id if stream.local_producer else None
        start_stats, steps, step_s, cpu = stream.stats, 0, 0.0, own_cpu_seconds()
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            next(stream)
            t = time.perf_counter()
            work(loops)
            time.sleep(sleep_s)
            step_s += time.perf_counter() - t
            steps += 1
        elapsed, cpu = time.perf_counter() - started, own_cpu_seconds() - cpu
        end_stats = stream.stats
    local_images = (end_stats.samples_per_producer.get(local_id, 0) - start_stats.samples_per_producer.get(local_id, 0)
                    if local_id else 0)
    return {"local": local is not None, "steps": steps, "images_per_s": steps * batch / elapsed,
            "local_images_per_s": local_images / elapsed, "step_ms": 1000 * step_s / max(1, steps),
            "trainer_cpu_ms_per_step": 1000 * (cpu - steps * work_s) / max(1, steps),
            "deaths": end_stats.local_producer_deaths}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of rounds (without, with), interleaved")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds a round")
    parser.add_argument("--busy-ms", type=float, default=10.0, help="CPU of a step (ms)")
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="sleep of a step: the accelerator (ms)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--slowdown", type=float, default=8.0, help="the remote producer runs 1/SLOWDOWN of the time")
    add_out_argument(parser, "local_producer.json")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores: the step on one, the local producer on the other")
    trainer_core, spare_core = cores[0], cores[1]
    flags = producer_flags(args.batch_size, args.image_size)
    rows = []
    with synthetic_lmdb(512) as lmdb, launch_producer(lmdb, flags) as remote, \
            Throttle(remote, args.slowdown):
        for pid in [remote.pid, *remote.child_pids()]:
            os.sched_setaffinity(pid, [spare_core])
        os.sched_setaffinity(0, [trainer_core])
        loops = loops_for(args.busy_ms / 1000)
        local = LocalProducer(str(lmdb), workers=1, extra_flags=flags[2:], cpus=[spare_core])
        for i in range(args.rounds):
            for with_local in (False, True):
                row = one_round(remote.endpoint, local if with_local else None, args.seconds,
                                loops, args.busy_ms / 1000, args.sleep_ms / 1000, args.batch_size)
                rows.append({"round": i, **row})
                print(f"round {i} {'with   ' if with_local else 'without'} local: {row['images_per_s']:7.1f} "
                      f"images/s (local {row['local_images_per_s']:6.1f}), step {row['step_ms']:6.2f} ms, receive "
                      f"CPU {row['trainer_cpu_ms_per_step']:5.2f} ms a step")
    pairs = [(rows[2 * i], rows[2 * i + 1]) for i in range(args.rounds)]
    ratios = [w["step_ms"] / wo["step_ms"] for wo, w in pairs]
    added = [w["images_per_s"] - wo["images_per_s"] for wo, w in pairs]
    summary = {"step_ratio_median": statistics.median(ratios), "step_ratio_min": min(ratios),
               "step_ratio_max": max(ratios), "images_per_s_added_median": statistics.median(added),
               "local_images_per_s_median": statistics.median(w["local_images_per_s"] for _, w in pairs),
               "images_per_s_without_median": statistics.median(wo["images_per_s"] for wo, _ in pairs),
               "receive_cpu_ms_per_step_without_median": statistics.median(wo["trainer_cpu_ms_per_step"]
                                                                           for wo, _ in pairs),
               "receive_cpu_ms_per_step_with_median": statistics.median(w["trainer_cpu_ms_per_step"] for _, w in pairs)}
    print("| | median | min | max |\n| --- | --- | --- | --- |")
    print(f"| step time with / without local producer | {summary['step_ratio_median']:.3f} | {min(ratios):.3f} | "
          f"{max(ratios):.3f} |")
    print(f"| images/s added (taken with - without) | {summary['images_per_s_added_median']:.0f} | {min(added):.0f} "
          f"| {max(added):.0f} |")
    print(f"| trainer CPU a step besides the step's work (receiving), ms: without / with | "
          f"{summary['receive_cpu_ms_per_step_without_median']:.2f} / {summary['receive_cpu_ms_per_step_with_median']:.2f}"
          " | | |")
    write_results(args.out, {**machine_info(), "args": vars(args), "cores": {"trainer": trainer_core,
                             "local_producer": spare_core, "remote": spare_core}, "rounds": rows, **summary})


if __name__ == "__main__":
    main()
