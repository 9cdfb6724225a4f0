#!/usr/bin/env python3
"""Records/s reading one Parquet shard through ``ParquetShard`` against pyarrow reading the same file directly, in
one run (issue 42).

The file is shaped like a Hugging Face image dataset: an image struct ``{bytes, path}`` of ``--image-bytes``
random bytes a row (the reader never decodes images), a caption and a label, ``--group`` rows a row group.

- sequential: every row in order. Stoker: ``shard.read(i)`` for each i (one decode a row group, kept);
  pyarrow: ``read_row_group`` of each group, then ``to_pylist()`` (rows as dicts, the image struct flattened).
- random: ``--random`` rows in a shuffled order. Stoker: ``shard.read(i)``; pyarrow: ``read_row_group`` of the
  row's group and that row taken (``slice(row, 1).to_pylist()``), with no cache: what a reader without one pays.
- shuffled: a permutation of all the shard's rows, the producer's own pattern (the epoch order shuffles the records
  within each shard). Stoker: ``shard.read(i)`` (its decoded row groups kept, bounded by bytes); pyarrow: the
  whole file read into memory, then ``take(permutation).to_pylist()``: the best a reader holding the file can do.

Each Stoker round opens the shard afresh (a new shard starts with nothing decoded). Rounds interleave the six;
each figure is the median over ``--rounds``, the ratio Stoker / pyarrow with its spread (min-max of the per-round
ratios). Prints a table and writes JSON (default benchmarks/results/parquet_read.json).
Run:  python benchmarks/parquet_read.py [--rows 8000] [--group 500] [--image-bytes 30000] [--rounds 5]
      [--random 400] [--decoded-mib 1024] [--no-shuffled] (the shuffled pattern reads every row: skip it to measure a slow reader)
"""

from __future__ import annotations

import bisect
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness import add_out_argument, benchmark_parser, machine_info, write_results
from stoker.producer.dataset.sources.lmdb_format import DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import ShardInfo
from stoker.producer.dataset.sources.parquet_shard import DECODED_CACHE_BYTES, DecodedGroups, ParquetFormat

FIELDS = {"image": FieldKind("image"), "text": FieldKind("str"), "label": FieldKind("int")}


def write_file(path: Path, rows: int, group: int, image_bytes: int) -> None:
    images = [{"bytes": os.urandom(image_bytes), "path": f"{i:08d}.jpg"} for i in range(rows)]
    table = pa.table({"image": images, "text": [f"a photo of thing {i}" for i in range(rows)],
                      "label": pa.array([i % 1000 for i in range(rows)], pa.int64())})
    pq.write_table(table, path, row_group_size=group)


def stoker_reads(path: Path, rows: int, order: list[int], budget: int) -> float:
    shard = ParquetFormat(DecodedGroups(budget)).open(path, ShardInfo(path.name, 0, rows, path.stat().st_size, "0" * 64),
                        DatasetMeta(count=rows, fields=FIELDS))
    start = time.perf_counter()
    for i in order:
        shard.read(i)
    elapsed = time.perf_counter() - start
    shard.close()
    return len(order) / elapsed


def pyarrow_sequential(path: Path, rows: int) -> float:
    start = time.perf_counter()
    parquet = pq.ParquetFile(path)
    read = 0
    for g in range(parquet.num_row_groups):
        table = parquet.read_row_group(g, columns=["image.bytes", "text", "label"])
        read += len(table.flatten().to_pylist())
    assert read == rows
    return rows / (time.perf_counter() - start)


def pyarrow_random(path: Path, order: list[int]) -> float:
    start = time.perf_counter()
    parquet = pq.ParquetFile(path)
    starts, total = [], 0
    for g in range(parquet.num_row_groups):
        starts.append(total)
        total += parquet.metadata.row_group(g).num_rows
    for i in order:
        g = bisect.bisect_right(starts, i) - 1
        table = parquet.read_row_group(g, columns=["image.bytes", "text", "label"])
        table.slice(i - starts[g], 1).flatten().to_pylist()
    return len(order) / (time.perf_counter() - start)


def pyarrow_shuffled(path: Path, order: list[int]) -> float:
    start = time.perf_counter()
    table = pq.read_table(path, columns=["image.bytes", "text", "label"])
    read = len(table.take(pa.array(order)).flatten().to_pylist())
    assert read == len(order)
    return len(order) / (time.perf_counter() - start)


MODES = {"seq": "sequential", "rand": "random", "shuf": "shuffled"}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--group", type=int, default=500, help="rows a row group")
    parser.add_argument("--image-bytes", type=int, default=30000)
    parser.add_argument("--random", type=int, default=400, help="rows read in a random order")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-shuffled", dest="shuffled", action="store_false",
                        help="skip the permutation of every row (minutes on a reader without a decoded-group cache)")
    parser.add_argument("--decoded-mib", type=int, default=DECODED_CACHE_BYTES >> 20,
                        help="the budget for decoded row groups (below the file's decoded size: groups evicted)")
    add_out_argument(parser, "parquet_read.json")
    args = parser.parse_args()
    budget = args.decoded_mib << 20
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train-00000.parquet"
        write_file(path, args.rows, args.group, args.image_bytes)
        shuffled = random.Random(0).sample(range(args.rows), args.random)
        permutation = random.Random(1).sample(range(args.rows), args.rows)
        modes = [m for m in MODES if m != "shuf" or args.shuffled]
        runs: dict[str, list[float]] = {f"{who}_{m}": [] for m in modes for who in ("stoker", "arrow")}
        for _ in range(args.rounds):  # interleaved: each round measures every pattern on the same warm file
            runs["stoker_seq"].append(stoker_reads(path, args.rows, list(range(args.rows)), budget))
            runs["arrow_seq"].append(pyarrow_sequential(path, args.rows))
            runs["stoker_rand"].append(stoker_reads(path, args.rows, shuffled, budget))
            runs["arrow_rand"].append(pyarrow_random(path, shuffled))
            if args.shuffled:
                runs["stoker_shuf"].append(stoker_reads(path, args.rows, permutation, budget))
                runs["arrow_shuf"].append(pyarrow_shuffled(path, permutation))
    result = {"machine": machine_info(), "args": vars(args), "runs": runs}
    print(f"{'reading':<12}{'Stoker rec/s':>14}{'pyarrow rec/s':>15}{'ratio':>8}  spread")
    for mode in modes:
        ours, theirs = runs[f"stoker_{mode}"], runs[f"arrow_{mode}"]
        ratios = [a / b for a, b in zip(ours, theirs)]
        result[mode] = {"stoker": statistics.median(ours), "pyarrow": statistics.median(theirs),
                        "ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)]}
        print(f"{MODES[mode]:<12}{statistics.median(ours):>14,.0f}"
              f"{statistics.median(theirs):>15,.0f}{statistics.median(ratios):>8.2f}  "
              f"{min(ratios):.2f}-{max(ratios):.2f}")
    write_results(args.out, result)


if __name__ == "__main__":
    main()
