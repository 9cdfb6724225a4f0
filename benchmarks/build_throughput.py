#!/usr/bin/env python3
"""The builder's throughput writing a sharded dataset against one LMDB, from the same image folder, in one run.

An ImageNet-style folder of synthetic JPEGs (``--records``, 300-500 px, ``--classes`` class folders) is built with
``build_lmdb`` (the code behind ``stoker lmdb build``) into one LMDB and into a sharded dataset (``--shard-size``:
every shard hashed, the manifest written, the folder's files written in a shuffled order); interleaved rounds,
the order alternating, the median kept. Target (issue 33): sharded within noise of single (ratio ~1.0; the spread
of the rounds is the noise). Prints a table and writes JSON (default benchmarks/results/build_throughput.json).
Run:  python benchmarks/build_throughput.py [--records 2000] [--shard-size 16MB] [--rounds 5]
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from harness import add_out_argument, benchmark_parser, machine_info, write_results


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--shard-size", default="16MB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    add_out_argument(parser, "build_throughput.json")
    return parser.parse_args()


def _image_folder(tmp: Path, records: int, classes: int) -> tuple[Path, int]:
    """The synthetic dataset's JPEGs as SRC/<class>/<n>.jpg; (the folder, its bytes)."""
    from stoker.producer.dataset.sources import LmdbDataset
    from stoker.producer.dataset.build.synthetic import build_synthetic

    build_synthetic(tmp / "synth", records, seed=0, num_classes=classes, progress=False)
    src, total = tmp / "src", 0
    with LmdbDataset(tmp / "synth") as ds:
        for i in range(len(ds)):
            record = ds.read(i)
            folder = src / f"class{int(record['label']):03d}"
            folder.mkdir(parents=True, exist_ok=True)
            data = bytes(record["image"])
            (folder / f"{i:06d}.jpg").write_bytes(data)
            total += len(data)
    return src, total


def _build(src: Path, out: Path, shard_bytes, threads: int) -> float:
    from stoker.producer.dataset.build.builder import build_lmdb

    started = time.perf_counter()
    build_lmdb(src, out, overwrite=True, threads=threads, progress=False, shard_bytes=shard_bytes)
    seconds = time.perf_counter() - started
    shutil.rmtree(out)
    return seconds


def main() -> None:
    args = parse_args()
    from stoker.producer.dataset.build.sharded_writer import parse_bytes

    shard_bytes = parse_bytes(args.shard_size)
    seconds: dict[str, list[float]] = {"single": [], "sharded": []}
    with tempfile.TemporaryDirectory() as tmp:
        src, total = _image_folder(Path(tmp), args.records, args.classes)
        _build(src, Path(tmp) / "warm", None, args.threads)  # page cache warm for both
        for r in range(args.rounds):
            for kind in (("single", "sharded") if r % 2 == 0 else ("sharded", "single")):
                seconds[kind].append(_build(src, Path(tmp) / kind, shard_bytes if kind == "sharded" else None,
                                            args.threads))
    rate = {k: args.records / statistics.median(v) for k, v in seconds.items()}
    ratios = [a / b for a, b in zip(seconds["single"], seconds["sharded"])]
    print(f"stoker lmdb build of {args.records} JPEGs ({total / 1e6:.0f} MB, {args.threads} threads): one LMDB vs "
          f"shards of {args.shard_size}; median of {args.rounds} interleaved rounds")
    print(f"{'output':>8} | {'images/s':>8} | {'MB/s':>6} | {'seconds (rounds)':>30}")
    for kind in ("single", "sharded"):
        rounds = ", ".join(f"{s:.2f}" for s in seconds[kind])
        print(f"{kind:>8} | {rate[kind]:>8.0f} | {rate[kind] * total / args.records / 1e6:>6.1f} | {rounds:>30}")
    print(f"sharded / single images/s: {rate['sharded'] / rate['single']:.3f} (per-round ratios "
          f"{min(ratios):.3f}-{max(ratios):.3f})")
    write_results(args.out, {"benchmark": "build_throughput", "records": args.records, "bytes": total,
                             "shard_size": args.shard_size, "threads": args.threads, "seconds": seconds,
                             "images_per_s": rate, "ratio": rate["sharded"] / rate["single"],
                             "round_ratios": ratios, **machine_info()})


if __name__ == "__main__":
    main()
