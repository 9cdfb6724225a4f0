#!/usr/bin/env python3
"""A pure-Python user transform scales with --workers: 1 vs 2 worker processes, delivered to another process.

The pipeline below (``make_pipeline``) does what numpy cannot vectorise for a user: a box
blur over a thumbnail written as plain Python loops, holding the GIL all the way. Threads
would not scale it; Stoker's worker processes do. Measured in one run:

1. the transform alone in this process, one thread: samples/s per core (the limit);
2. ``stoker produce --pipeline benchmarks/user_pipeline_scaling.py:make_pipeline`` with 1 and
   2 workers, batches received and decoded by this process over tcp://127.0.0.1.

Target: 2 workers >= 1.8 x 1 worker. Interleaved rounds, best kept. Prints a table and writes
JSON (default benchmarks/results/user_pipeline_scaling.json).
Run:  python benchmarks/user_pipeline_scaling.py [--batches 40] [--rounds 2]
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from stoker.producer.pipeline import Field, Pipeline

THUMB = 20


def _python_blur(pixels: list[list[int]]) -> list[list[int]]:
    """3x3 box blur in pure Python: the kind of per-element code users write and numpy cannot help."""
    n = len(pixels)
    out = [[0] * n for _ in range(n)]
    for y in range(n):
        for x in range(n):
            total = count = 0
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    yy, xx = y + dy, x + dx
                    if 0 <= yy < n and 0 <= xx < n:
                        total += pixels[yy][xx]
                        count += 1
            out[y][x] = total // count
    return out


def make_pipeline(passes: int = 6) -> Pipeline:
    """A pure-Python pipeline: a grey thumbnail of the record's image, blurred ``passes`` times in Python."""
    from stoker.producer.images.decode import decode_rgb

    def sample(record, rng):
        import cv2

        grey = cv2.resize(decode_rgb(record["image"]), (THUMB, THUMB), interpolation=cv2.INTER_AREA).mean(axis=2)
        pixels = grey.astype(int).tolist()
        for _ in range(passes):
            pixels = _python_blur(pixels)
        return {"thumbs": np.asarray(pixels, np.uint8), "labels": record["label"]}

    return Pipeline([Field("thumbs", "uint8", (THUMB, THUMB)), Field("labels", "int32")], sample=sample,
                    name="python-blur")


def transform_alone(lmdb_path: Path, seconds: float) -> float:
    from stoker.producer.dataset.sources import LmdbDataset
    from stoker.producer.serve.sharding import RecordRng

    pipeline = make_pipeline()
    rng = RecordRng(0)
    with LmdbDataset(lmdb_path) as ds:
        records = [ds.read(i) for i in range(min(64, len(ds)))]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pipeline.sample(records[n % len(records)], rng.for_record(0, n))  # type: ignore[misc]
        n += 1
    return n / (time.perf_counter() - t0)


def delivered(lmdb_path: Path, workers: int, batch: int, warmup: int, batches: int) -> float:
    # Here, not at the top: the producer imports this file for make_pipeline without benchmarks/ on its path.
    from delivery import delivered_rate
    from harness import launch_producer, producer_flags

    flags = [*producer_flags(batch, workers=workers, seed=0), "--pipeline", f"{__file__}:make_pipeline"]

    def check(decoded) -> None:
        assert decoded["thumbs"].shape == (batch, THUMB, THUMB)

    with launch_producer(lmdb_path, flags) as producer:
        return delivered_rate(producer, warmup, batches, check)


def main() -> None:
    from harness import add_out_argument, benchmark_parser, machine_info, synthetic_lmdb, write_results

    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=4.0, help="for the transform alone")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of each is kept")
    add_out_argument(parser, "user_pipeline_scaling.json")
    args = parser.parse_args()
    with synthetic_lmdb(args.records) as path:
        alone, rates = [], {1: [], 2: []}
        for _ in range(args.rounds):
            alone.append(transform_alone(path, args.seconds))
            for workers in (1, 2):
                rates[workers].append(delivered(path, workers, args.batch_size, args.warmup, args.batches))
    one, two = max(rates[1]), max(rates[2])
    print(f"pure-Python transform ({THUMB}x{THUMB} box blur x6 in Python loops), best of {args.rounds} rounds")
    print(f"transform alone, one thread: {max(alone):.0f} samples/s")
    print(f"{'workers':>7} | {'delivered samples/s':>19} | {'x 1 worker':>10}")
    print("-" * 44)
    print(f"{1:>7} | {one:>19.0f} | {1.0:>10.2f}")
    print(f"{2:>7} | {two:>19.0f} | {two / one:>10.2f}")
    result = {"benchmark": "user_pipeline_scaling", "transform_alone_samples_per_s": max(alone),
              "delivered_samples_per_s": {"1": one, "2": two}, "speedup_2_workers": two / one, "target": 1.8,
              "rounds": {"alone": alone, "1": rates[1], "2": rates[2]}, **machine_info()}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
