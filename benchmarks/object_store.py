#!/usr/bin/env python3
"""A producer reading its dataset from object storage, against the same producer on a local LMDB, one run.

A real S3 server runs on loopback (SeaweedFS, local_s3.py). The same synthetic JPEGs are written as one LMDB and
as a sharded dataset uploaded to a bucket. Interleaved rounds, the order alternating, each a fresh producer
(``--workers``, the imagenet pipeline, random-resized-crop) delivering to this process:

- local: ``--lmdb`` the LMDB folder;
- warm: ``--lmdb s3://...`` with a cache that already holds every shard (filled once before the rounds);
- cold: ``--lmdb s3://...`` with an empty cache each round, as a freshly scheduled pod: images/s after the
  warm-up, the seconds from the producer's start to its first batch, and the fetches' own MB/s (bytes over
  seconds per fetch, ``fetches.jsonl``).

Target (issue 33): warm >= 0.97 of local in images/s. Loopback S3 is much faster than a real bucket, so the cold
figure is an upper bound of what the fetch path costs here; its MB/s says how fast shards were taken in.
Prints a table and writes JSON (default benchmarks/results/object_store.json).
Run:  python benchmarks/object_store.py [--records 512] [--shard-size 8MB] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from delivery import delivered_rate
from harness import (add_out_argument, benchmark_parser, launch_producer, machine_info, producer_flags, run_stoker,
                     write_results)
from local_s3 import LocalS3


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=512, help="synthetic JPEGs (300-500 px)")
    parser.add_argument("--shard-size", default="8MB", help="the sharded copy's shard size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=4, help="batches before timing")
    parser.add_argument("--batches", type=int, default=40, help="batches timed per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is kept")
    add_out_argument(parser, "object_store.json")
    return parser.parse_args()


def _round(location: str, args, s3: LocalS3, cache: Path | None) -> tuple[float, float, float]:
    """(images/s, seconds from start to the first batch, the fetches' MB/s) of one producer."""
    flags = producer_flags(args.batch_size, args.image_size, args.workers, seed=0)
    if cache is not None:
        flags += ["--s3-endpoint", s3.endpoint, "--cache-dir", str(cache), "--cache-size", "100GB"]
    started, first = time.perf_counter(), {}
    with launch_producer(location, flags, env=s3.environment()) as producer:
        def check(batch) -> None:
            first.setdefault("t", time.perf_counter())
        rate = delivered_rate(producer, args.warmup, args.batches, check)
    return rate, first["t"] - started, _fetch_mb_per_s(cache)


def _fetch_mb_per_s(cache: Path | None) -> float:
    from stoker.producer.dataset.sources.shard_cache import fetch_log

    fetches = fetch_log(cache) if cache is not None else []
    if not fetches:
        return 0.0
    return sum(f["bytes"] for f in fetches) / 1e6 / max(1e-9, sum(f["seconds"] for f in fetches))


def main() -> None:
    args = parse_args()
    from stoker.producer.dataset.build.synthetic import build_synthetic
    from stoker.producer.dataset.sources import open_dataset

    rounds: dict[str, list] = {"local": [], "warm": [], "cold": []}
    with tempfile.TemporaryDirectory() as tmp, LocalS3(Path(tmp) / "s3") as s3:
        tmp_path = Path(tmp)
        build_synthetic(tmp_path / "single", args.records, seed=0, progress=False)
        run_stoker("lmdb", "synth", str(tmp_path / "sharded"), "--count", str(args.records), "--seed", "0",
                "--shard-size", args.shard_size, "--quiet", env=s3.environment())
        run_stoker("lmdb", "upload", str(tmp_path / "sharded"), "s3://stoker/bench", "--s3-endpoint", s3.endpoint,
                env=s3.environment())
        url = "s3://stoker/bench"
        with open_dataset(tmp_path / "sharded") as sharded:
            shards, dataset_mb = len(sharded.manifest.shards), sharded.size_bytes() / 1e6
        warm_cache = tmp_path / "warm"
        _round(url, args, s3, warm_cache)  # fills the warm cache (every shard, by the epoch it reads)
        for r in range(args.rounds):
            order = ("local", "warm", "cold") if r % 2 == 0 else ("cold", "warm", "local")
            for kind in order:
                if kind == "local":
                    rounds[kind].append(_round(str(tmp_path / "single"), args, s3, None))
                elif kind == "warm":
                    rounds[kind].append(_round(url, args, s3, warm_cache))
                else:
                    rounds[kind].append(_round(url, args, s3, tmp_path / f"cold{r}"))
    rate = {k: statistics.median(x[0] for x in v) for k, v in rounds.items()}
    first = {k: statistics.median(x[1] for x in v) for k, v in rounds.items()}
    fetched = statistics.median(x[2] for x in rounds["cold"])
    print(f"producer ({args.workers} workers, {args.batch_size} x {args.image_size} px, random-resized-crop): "
          f"local LMDB vs s3:// on a loopback S3 server, {shards} shards ({dataset_mb:.0f} MB), "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'source':>22} | {'images/s':>8} | {'ratio to local':>14} | {'first batch s':>13} | {'fetch MB/s':>10}")
    for kind, label in (("local", "local LMDB"), ("warm", "s3://, warm cache"), ("cold", "s3://, cold cache")):
        mbs = f"{fetched:.0f}" if kind == "cold" else "-"
        print(f"{label:>22} | {rate[kind]:>8.0f} | {rate[kind] / rate['local']:>14.3f} | {first[kind]:>13.2f} | "
              f"{mbs:>10}")
    write_results(args.out, {"benchmark": "object_store", "records": args.records, "shards": shards,
                             "dataset_mb": dataset_mb, "workers": args.workers, "batch_size": args.batch_size,
                             "image_size": args.image_size, "images_per_s": rate, "first_batch_s": first,
                             "warm_ratio": rate["warm"] / rate["local"], "cold_ratio": rate["cold"] / rate["local"],
                             "cold_fetch_mb_per_s": fetched, "target_warm_ratio": 0.97, "rounds": rounds,
                             **machine_info()})


if __name__ == "__main__":
    main()
