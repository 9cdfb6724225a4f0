#!/usr/bin/env python3
"""Where a one-machine Stoker run spends its CPU: the producer's workers, its daemon and the trainer, per image.

On shared cores the throughput of a producer and a trainer on one host is their CPU per image, so this is the
budget that a comparison with a DataLoader-based peer (``in_place.py``) comes down to. The image-text job of
``in_place.py`` (``--pipeline image_text``, 128 px, captions padded to 77, batches of 32, 2 workers) serves the
same img2dataset tars, read in place, to a ``BatchStream`` in this process, over TCP loopback (a data host) and
over ``ipc://`` (a Unix socket: a producer on the trainer's host); ``--repeat`` re-sends made batches instead
(no decoding: the transport's own cost per batch). For each: images/s, and the CPU microseconds per image of
the workers, the daemon and this process (``/proc``, ``getrusage``) over the timed batches. Interleaved rounds,
median (min-max).

Run:  python benchmarks/cpu_split.py [--rounds 3] [--batches 400] [--repeat]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import add_out_argument, benchmark_parser, launch_producer, machine_info, producer_flags, \
    producers_cpu_now, write_results
from in_place_data import caption_records, index_sources, write_sources

BINDS = {"tcp": "tcp://127.0.0.1:*", "ipc": "ipc://{tmp}/producer.sock"}
PARTS = ("workers", "daemon", "trainer")


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", action="store_true", help="re-send made batches: the transport's cost alone")
    add_out_argument(parser, "cpu_split.json")
    return parser.parse_args()


def measure(location: str, bind: str, args) -> dict[str, float]:
    """Images/s and CPU us per image of each part, one fresh producer."""
    from stoker.consumer import BatchStream

    flags = producer_flags(args.batch_size, 128, args.workers, seed=0, repeat_batches=args.repeat)
    flags += ["--pipeline", "image_text", "--pipeline-arg", "text_length=77"]
    with launch_producer(location, flags, bind=bind) as producer, \
            BatchStream([producer.endpoint], recv_timeout=120) as stream:
        batches = iter(stream)
        for _ in range(args.warmup):
            next(batches)
        before, started, images = producers_cpu_now([producer]), time.perf_counter(), 0
        for _ in range(args.batches):
            images += len(next(batches)["texts_len"])
        seconds, used = time.perf_counter() - started, producers_cpu_now([producer]) - before
    per_image = {"workers": used.workers, "daemon": used.daemons, "trainer": used.own}
    return {"images_per_s": images / seconds, **{k: v / images * 1e6 for k, v in per_image.items()}}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="cpu-split-") as tmp:
        files = write_sources(Path(tmp) / "data", caption_records(args.records, 256), 4)
        tar_index = index_sources(str(files.tars), str(files.parquet), Path(tmp) / "local")["tar"]
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in BINDS}
        for r in range(args.rounds):
            for name in list(BINDS)[r % 2:] + list(BINDS)[:r % 2]:
                runs[name].append(measure(tar_index, BINDS[name].format(tmp=tmp), args))
                row = runs[name][-1]
                print(f"round {r} {name}: {row['images_per_s']:.0f} images/s, "
                      + ", ".join(f"{p} {row[p]:.1f}" for p in PARTS) + " us/image", flush=True)
    summary: dict[str, Any] = {}
    print(f"tars in place, image_text, {args.workers} workers, batch {args.batch_size}"
          f"{', repeated batches' if args.repeat else ''}; {args.rounds} rounds, median (min-max)")
    print(f"{'bind':<6}{'images/s':>22}" + "".join(f"{p + ' us/img':>22}" for p in (*PARTS, "total")))
    for name, rows in runs.items():
        for row in rows:
            row["total"] = sum(row[p] for p in PARTS)
        summary[name] = {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                             "max": max(r[k] for r in rows)} for k in ("images_per_s", *PARTS, "total")}
        cells = [f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})" for s in summary[name].values()]
        print(f"{name:<6}" + "".join(f"{c:>22}" for c in cells))
    write_results(args.out, {"benchmark": "cpu_split", "repeat": args.repeat, "workers": args.workers,
                             "batch_size": args.batch_size, "batches": args.batches, "rounds": args.rounds,
                             "binds": summary, "raw": runs, **machine_info()})


if __name__ == "__main__":
    main()
