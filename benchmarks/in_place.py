#!/usr/bin/env python3
"""Data served where it lies (issue 42): WebDataset tars and Parquet files against the same records converted to
sharded Stoker LMDB, and Stoker against the webdataset library in a PyTorch DataLoader, in one run.

The same ``--records`` synthetic JPEGs (about ``--side`` px, ~20 KB) with captions are written three ways
(``in_place_data.py``): sharded LMDB (``write_lmdb(shard_bytes=...)``), img2dataset-style tars + their index,
Hugging Face-style Parquet files (image struct + text, row groups of 100) + their index; ``--shards`` shards each.
A real S3 server runs on loopback (SeaweedFS, local_s3.py) holding the three copies. Each Stoker measurement is a
fresh producer (``--workers``, ``--pipeline image_text``: random-resized-crop to ``--image-size`` + flip, the
caption as UTF-8 bytes padded to 77; exact mode off) delivering to a ``BatchStream`` in this process, images/s
over ``--batches`` batches after ``--warmup``:

- local: the LMDB folder, the tar index, the Parquet index on this disk, over TCP (loopback), as from a data host;
- tar local ipc: the tar index again, the producer bound to ``ipc://`` (a Unix socket: where a producer on the
  trainer's own host is reached, ``--local-producer``), which is how a one-machine job like this one runs;
- s3 warm: the same from ``s3://`` through a cache that already holds every shard (filled by the cold pass);
- s3 cold (once per source, before the rounds; it fills the warm cache): an empty cache, the first epoch's
  images/s from the producer's launch to its last full batch, and the fetches' MB/s (``fetches.jsonl``);
- webdataset: ``wds.WebDataset(tars, resampled=True).shuffle(1000).map(job).batched(B)`` in a
  ``DataLoader(num_workers=--workers, batch_size=None)``, where ``job`` is the same image-text work done with
  Stoker's own decode helpers (``decode_train_crop``: the crop-window JPEG decoder; ``resize_flip_into``;
  ``utf8_into`` padding the caption to 77), so the kernels are equal and the input paths are what differs;
- litdata (with ``--litdata-python PATH``, a Python whose venv holds litdata: its install conflicts with Stoker's
  torch and botocore, so it runs as a subprocess, ``litdata_baseline.py``): the tars converted once with
  ``litdata.optimize`` to LitData's own chunks (one per tar; the seconds and bytes reported apart, before the
  rounds), read by ``StreamingDataset(shuffle=True)`` in a ``StreamingDataLoader(num_workers=--workers)`` doing
  the same job with the same kernels. Without the option its row is "not measured: pass --litdata-python".

Interleaved rounds, the order rotating each round; ratios are taken within a round (tar/LMDB, parquet/LMDB on
the same medium; Stoker's tar over TCP and over ipc / webdataset, / litdata, / the faster of the two) and reported as median
(min-max over rounds). Targets (issue 42): in place / LMDB >= 0.95 warm, local and s3; Stoker >= 1.3x the best
of the peers. Everything shares this machine's cores.
Prints a table and writes JSON (default benchmarks/results/in_place.json).
Run:  python benchmarks/in_place.py [--records 2000] [--shards 4] [--rounds 3] [--workers 2] [--no-s3]
                                    [--litdata-python /work/litvenv/bin/python]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from harness import add_out_argument, benchmark_parser, launch_producer, machine_info, producer_flags, write_results
from in_place_data import caption_records, index_sources, upload_sources, write_sources
from litdata_baseline import convert_with, read_rate_with

SOURCES = ("lmdb", "tar", "parquet")
TEXT_LENGTH = 77


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=2000, help="synthetic JPEGs with captions")
    parser.add_argument("--side", type=int, default=256, help="the JPEGs' side in px, about")
    parser.add_argument("--shards", type=int, default=4, help="shards of each copy")
    parser.add_argument("--workers", type=int, default=2, help="producer workers and DataLoader workers")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=20,
                        help="batches before timing (more than the producer and the stream hold queued)")
    parser.add_argument("--batches", type=int, default=250, help="batches timed per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--no-s3", action="store_true", help="local disk only (no SeaweedFS)")
    parser.add_argument("--litdata-python", metavar="PATH",
                        help="a Python with litdata installed (a venv of its own): adds the LitData peer")
    add_out_argument(parser, "in_place.json")
    return parser.parse_args()


def _flags(args, cache: Optional[Path], s3: Any) -> list[str]:
    flags = producer_flags(args.batch_size, args.image_size, args.workers, seed=0)
    flags += ["--pipeline", "image_text", "--pipeline-arg", f"text_length={TEXT_LENGTH}"]
    if cache is not None:
        flags += ["--s3-endpoint", s3.endpoint, "--cache-dir", str(cache), "--cache-size", "100GB"]
    return flags


def _check(batch: dict, args) -> None:
    assert batch["images"].shape == (args.batch_size, args.image_size, args.image_size, 3), batch["images"].shape
    assert batch["texts"].shape == (args.batch_size, TEXT_LENGTH) and batch["texts_len"].min() > 0


def stoker_rate(location: str, args, cache: Optional[Path] = None, s3: Any = None,
                bind: str = "tcp://127.0.0.1:*") -> float:
    """Images/s a fresh producer serving ``location`` from ``bind`` delivers to a BatchStream here, after the
    warm-up."""
    from stoker.consumer import BatchStream

    env = s3.environment() if s3 is not None else None
    with launch_producer(location, _flags(args, cache, s3), env=env, bind=bind) as producer, \
            BatchStream([producer.endpoint], recv_timeout=120) as stream:
        batches = iter(stream)
        for _ in range(args.warmup):
            _check(next(batches), args)
        started, images = time.perf_counter(), 0
        for _ in range(args.batches):
            images += len(next(batches)["texts_len"])
        return images / (time.perf_counter() - started)


def cold_epoch(location: str, args, cache: Path, s3: Any) -> dict[str, float]:
    """A producer with an empty cache: its first epoch from launch to the last full batch (seconds, images/s), its
    first batch (s) and the fetches' bytes and MB/s."""
    from stoker.consumer import BatchStream
    from stoker.producer.dataset.sources.shard_cache import fetch_log

    whole = args.records - args.records % args.batch_size  # a last partial batch may be left out of the epoch
    started = time.perf_counter()
    with launch_producer(location, _flags(args, cache, s3), env=s3.environment()) as producer, \
            BatchStream([producer.endpoint], recv_timeout=120) as stream:
        first, seen = None, 0
        for batch in stream:
            first = first or time.perf_counter() - started
            seen += int((batch["epoch"] == 0).sum())
            if seen >= whole:
                break
        seconds = time.perf_counter() - started
    fetches = fetch_log(cache)
    fetched = sum(f["bytes"] for f in fetches)
    return {"seconds": seconds, "images_per_s": seen / seconds, "first_batch_s": first, "fetches": len(fetches),
            "fetched_mb": fetched / 1e6, "fetch_mb_per_s": fetched / 1e6 / max(1e-9, sum(f["seconds"] for f in fetches))}


class ImageTextJob:
    """The image_text pipeline's work on one webdataset sample, with Stoker's own helpers: the crop-window decode,
    resize + flip, the caption's UTF-8 bytes padded to 77. A generator per worker process (made on first use)."""

    def __init__(self, image_size: int) -> None:
        self.image_size, self.rng = image_size, None

    def __call__(self, sample: dict) -> tuple:
        import numpy as np

        from stoker.producer.images.augment import decode_train_crop, resize_flip_into
        from stoker.producer.images.image_text import utf8_into

        if self.rng is None:
            self.rng = np.random.default_rng()
        image = np.empty((self.image_size, self.image_size, 3), np.uint8)
        resize_flip_into(decode_train_crop(sample["jpg"], self.rng), self.image_size, self.rng, image)
        text = np.empty(TEXT_LENGTH, np.uint8)
        return image, text, utf8_into(sample["txt"].decode(), text, False, "txt")


def webdataset_rate(tars: list[str], args) -> float:
    """Images/s of the webdataset library in a DataLoader (``args.workers`` workers) doing the image-text job."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    dataset = (wds.WebDataset(tars, resampled=True, shardshuffle=False).shuffle(1000)
               .map(ImageTextJob(args.image_size)).batched(args.batch_size, partial=False))
    loader = DataLoader(dataset, batch_size=None, num_workers=args.workers)
    batches = iter(loader)
    try:
        for _ in range(args.warmup):
            images, texts, lengths = next(batches)
            assert tuple(images.shape) == (args.batch_size, args.image_size, args.image_size, 3)
            assert tuple(texts.shape) == (args.batch_size, TEXT_LENGTH)
        started, count = time.perf_counter(), 0
        for _ in range(args.batches):
            count += len(next(batches)[2])
        return count / (time.perf_counter() - started)
    finally:
        del batches  # its workers go with it


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], digits: int = 0) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def measure(args, tmp: Path, s3: Any) -> dict[str, Any]:
    """The data written, uploaded and indexed; the cold pass; the interleaved rounds. Every figure, raw."""
    files = write_sources(tmp / "data", caption_records(args.records, args.side), args.shards)
    local = {"lmdb": str(files.lmdb), **index_sources(str(files.tars), str(files.parquet), tmp / "local")}
    tars = [str(p) for p in sorted(files.tars.glob("*.tar"))]
    kinds: dict[str, Any] = {f"{s} local": (lambda s=s: stoker_rate(local[s], args)) for s in SOURCES}
    kinds["tar local ipc"] = lambda: stoker_rate(local["tar"], args, bind=f"ipc://{tmp}/producer.sock")
    kinds["webdataset"] = lambda: webdataset_rate(tars, args)
    litdata: dict[str, Any] = {}
    if args.litdata_python:
        litdata["conversion"] = convert_with(args.litdata_python, files.tars, tmp / "litdata", args.shards,
                                             args.workers)
        print(f"litdata conversion: {litdata['conversion']}", flush=True)
        litdata["reads"] = []

        def litdata_rate() -> float:
            litdata["reads"].append(read_rate_with(args.litdata_python, tmp / "litdata", args))
            return litdata["reads"][-1]["images_per_s"]

        kinds["litdata"] = litdata_rate
    cold: dict[str, dict] = {}
    if s3 is not None:
        urls = upload_sources(files, s3, "inplace")
        options = {"key": s3.environment()["AWS_ACCESS_KEY_ID"], "secret": s3.environment()["AWS_SECRET_ACCESS_KEY"],
                   "client_kwargs": {"endpoint_url": s3.endpoint}}
        remote = {"lmdb": urls["lmdb"], **index_sources(urls["tar"], urls["parquet"], tmp / "s3", options)}
        for s in SOURCES:
            cold[s] = cold_epoch(remote[s], args, tmp / f"cache-{s}", s3)
            print(f"cold {s}: {cold[s]}", flush=True)
            kinds[f"{s} s3 warm"] = lambda s=s: stoker_rate(remote[s], args, tmp / f"cache-{s}", s3)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for r in range(args.rounds):
        for kind in names[r % len(names):] + names[:r % len(names)]:
            rates[kind].append(kinds[kind]())
            print(f"round {r} {kind}: {rates[kind][-1]:.0f} images/s", flush=True)
    sizes = {s: sum(p.stat().st_size for p in Path(getattr(files, s)).rglob("*") if p.is_file())
             for s in ("lmdb", "tars", "parquet")}
    return {"rates": rates, "cold": cold, "dataset_bytes": sizes, "litdata": litdata}


def summarise(args, measured: dict[str, Any]) -> dict[str, Any]:
    """Medians and spreads, ratios per round, the table printed."""
    rates = measured["rates"]
    media = ["local"] + (["s3 warm"] if measured["cold"] else [])
    ratios = {f"{s}/lmdb {m}": [a / b for a, b in zip(rates[f"{s} {m}"], rates[f"lmdb {m}"])]
              for m in media for s in ("tar", "parquet")}
    for stoker in ("tar local", "tar local ipc"):
        ratios[f"stoker {stoker}/webdataset"] = [a / b for a, b in zip(rates[stoker], rates["webdataset"])]
        if "litdata" in rates:
            ratios[f"stoker {stoker}/litdata"] = [a / b for a, b in zip(rates[stoker], rates["litdata"])]
            ratios[f"stoker {stoker}/best peer"] = [a / max(w, l) for a, w, l in
                                                    zip(rates[stoker], rates["webdataset"], rates["litdata"])]
    rows = {k: _spread(v) for k, v in rates.items()}
    ratio_rows = {k: _spread(v) for k, v in ratios.items()}
    print(f"{args.records} records (~{args.side} px JPEGs + captions), {args.shards} shards each; one producer, "
          f"{args.workers} workers, image_text {args.image_size} px, batch {args.batch_size}, BatchStream; "
          f"{args.rounds} interleaved rounds, median (min-max); all on this machine's {machine_info()['cpus']} "
          "shared cores")
    print(f"{'input':<20}{'images/s':>22}")
    for kind, row in rows.items():
        print(f"{kind:<20}{_fmt(row):>22}")
    litdata = measured["litdata"]
    if not litdata:
        print(f"{'litdata':<20}{'not measured: pass --litdata-python':>40}")
    print(f"{'ratio':<34}{'median (min-max)':>22}")
    for kind, row in ratio_rows.items():
        print(f"{kind:<34}{_fmt(row, 3):>22}")
    for s, c in measured["cold"].items():
        print(f"cold s3 first epoch, {s}: {c['images_per_s']:.0f} images/s over {c['seconds']:.1f} s from launch "
              f"(first batch {c['first_batch_s']:.1f} s); {c['fetches']} fetches, {c['fetched_mb']:.0f} MB at "
              f"{c['fetch_mb_per_s']:.0f} MB/s")
    if litdata:
        c, read = litdata["conversion"], litdata["reads"][-1]
        print(f"litdata {read['litdata']} (torch {read['torch']}): optimize wrote {c['samples']} samples in "
              f"{c['chunks']} chunks, {c['bytes'] / 1e6:.1f} MB in {c['seconds']:.1f} s ({args.workers} workers), "
              f"once before the rounds; each read ran {read['epochs_started']} epochs back to back")
    return {"benchmark": "in_place", "records": args.records, "side": args.side, "shards": args.shards,
            "workers": args.workers, "batch_size": args.batch_size, "image_size": args.image_size,
            "batches": args.batches, "rounds": args.rounds, "images_per_s": rows, "ratios": ratio_rows,
            "cold_s3": measured["cold"], "dataset_bytes": measured["dataset_bytes"], "raw": measured["rates"],
            "raw_ratios": ratios, "targets": {"in_place_over_lmdb": 0.95, "stoker_over_best_peer": 1.3},
            "peer_decode": "Stoker's decode_train_crop + resize_flip_into + utf8_into in the DataLoader workers",
            "litdata": litdata or "not measured: pass --litdata-python", **machine_info()}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="in-place-") as tmp, ExitStack() as stack:
        s3 = None
        if not args.no_s3:
            from local_s3 import LocalS3

            s3 = stack.enter_context(LocalS3(Path(tmp) / "s3"))
        measured = measure(args, Path(tmp), s3)
    write_results(args.out, summarise(args, measured))


if __name__ == "__main__":
    main()
