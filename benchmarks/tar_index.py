#!/usr/bin/env python3
"""Building a WebDataset index against reading the same tars once, in one run (issue 42's target: MB/s of the
index against reading the tar once).

``--tars`` tars of ``--samples`` samples each are written as img2dataset writes them (``NNNNNNNNN.jpg`` of
``--image-kb`` KB of random bytes: the index never decodes, so content does not matter; ``.txt``; ``.json``;
``.cls``). Three ways over the same files, page cache warm, interleaved rounds with the order rotating, the
median kept and the spread (min-max over rounds) stated:

- ``read+sha256``: the baseline, each file read once in 8 MiB chunks and hashed, nothing else;
- ``index_webdataset``: the index command's library call (each tar streamed once: the header walk, every byte
  hashed, the .cls bodies read, the manifest checked);
- ``open (headers)``: ``TarShard`` opening a local tar: its header walk with seeks, no body read, no hash (what a
  producer pays per tar it opens), in MB of tar indexed per second.

Prints a table and writes JSON (default benchmarks/results/tar_index.json).
Run:  python benchmarks/tar_index.py [--tars 4] [--samples 1000] [--image-kb 48] [--rounds 5]
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from harness import add_out_argument, benchmark_parser, machine_info, write_results


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--tars", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--image-kb", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    add_out_argument(parser, "tar_index.json")
    return parser.parse_args()


def write_tars(folder: Path, tars: int, samples: int, image_kb: int) -> list[Path]:
    """img2dataset-style tars of random bytes (sizes varying +-50% around ``image_kb``)."""
    rng, paths = __import__("random").Random(0), []
    for t in range(tars):
        path = folder / f"{t:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for s in range(samples):
                key = f"{t * samples + s:09d}"
                members = {"jpg": os.urandom(int(image_kb * 1024 * rng.uniform(0.5, 1.5))),
                           "txt": f"a photo of thing {s}".encode(),
                           "json": json.dumps({"key": key, "width": 256, "height": 256, "caption": "x" * 80}).encode(),
                           "cls": str(s % 1000).encode()}
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def read_and_hash(paths: list[Path]) -> None:
    for path in paths:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)


def index(paths: list[Path]) -> None:
    from stoker.producer.dataset.build.webdataset_index import index_webdataset

    index_webdataset([str(p) for p in paths], progress=False)


def open_headers(paths: list[Path]) -> None:
    from stoker.producer.dataset.sources.lmdb_format import DatasetMeta, FieldKind
    from stoker.producer.dataset.sources.tar_shard import TarShard

    meta = DatasetMeta(count=1, fields={"image": FieldKind("image")})
    for path in paths:
        TarShard(path, path.name, meta).close()


WAYS = {"read+sha256": read_and_hash, "index_webdataset": index, "open (headers)": open_headers}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="tar-index-") as tmp:
        paths = write_tars(Path(tmp), args.tars, args.samples, args.image_kb)
        total_mb = sum(p.stat().st_size for p in paths) / 1e6
        read_and_hash(paths)  # warm the page cache
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        names = list(WAYS)
        for r in range(args.rounds):
            for way in names[r % len(names):] + names[:r % len(names)]:  # the order rotates each round
                started = time.perf_counter()
                WAYS[way](paths)
                rates[way].append(total_mb / (time.perf_counter() - started))
    base = rates["read+sha256"]
    rows = {}
    print(f"{args.tars} tars, {args.samples} samples each, {total_mb:.0f} MB, {args.rounds} interleaved rounds")
    print(f"{'way':<18}{'MB/s median':>12}{'min-max':>18}{'x read+sha256':>15}{'ratio min-max':>16}")
    for way, values in rates.items():
        ratios = [v / b for v, b in zip(values, base)]  # per round: both measured in the same round
        rows[way] = {"mb_per_s": statistics.median(values), "mb_per_s_min": min(values), "mb_per_s_max": max(values),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "rounds": values}
        print(f"{way:<18}{rows[way]['mb_per_s']:>12.0f}{f'{min(values):.0f}-{max(values):.0f}':>18}"
              f"{rows[way]['ratio']:>15.2f}{f'{min(ratios):.2f}-{max(ratios):.2f}':>16}")
    write_results(args.out, {"machine": machine_info(), "tars": args.tars, "samples": args.samples,
                             "image_kb": args.image_kb, "total_mb": total_mb, "rounds": args.rounds, "ways": rows})


if __name__ == "__main__":
    main()
