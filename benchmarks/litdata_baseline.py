#!/usr/bin/env python3
"""LitData as a peer for ``in_place.py`` (issue 42), run in a Python of its own: LitData's install pins a torch and
a botocore that conflict with Stoker's venv, so ``in_place.py --litdata-python PATH`` runs this file with that
Python, a venv outside the repository holding litdata, torch (CPU), numpy, opencv-python-headless. It prints one
JSON line per command; stdout has nothing else.

- ``convert TARS OUT``: the img2dataset tars under TARS (``*.jpg`` + ``*.txt``, the ``.json`` left out, as the
  Stoker sources leave it out) written once with ``litdata.optimize`` as LitData's own chunks under OUT, about
  ``--chunks`` chunks (one per tar, as the other copies have one shard per tar). Prints seconds, samples, bytes.
- ``read DATA``: ``StreamingDataset(DATA, shuffle=True, transform=job)`` in a ``StreamingDataLoader(num_workers=
  --workers, batch_size=--batch-size, drop_last=True, persistent_workers=True)``, ``--batches`` batches timed
  after ``--warmup``, epochs run back to back (an epoch of 2,000 samples is 62 batches of 32: the loader's epoch
  turn-overs are in the timing, as they would be in training). Prints images/s, samples, seconds.

``job`` is the image-text work of in_place.py's webdataset peer: Stoker's own kernels (``decode_train_crop``, the
crop-window JPEG decoder; ``resize_flip_into``) imported from this checkout's ``producer/images`` (which needs only
numpy and cv2), and the caption's UTF-8 bytes padded to 77 as ``image_text.utf8_into`` does it (cut before a whole
character; the rest of that module needs Stoker's dependencies). Only the input path differs.
The driver side, ``convert_with`` and ``read_rate_with``, is what in_place.py calls from Stoker's venv.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Iterator

REPOSITORY = Path(__file__).resolve().parents[1]  # the folder holding producer/, which setup.py maps to stoker.*
TEXT_LENGTH = 77
TIMEOUT_S = 600


# ---- the driver, in Stoker's venv ----------------------------------------------------------------

def _run(python: str, *argv: str) -> dict[str, Any]:
    """This file run by ``python`` with ``argv``; its JSON line. RuntimeError with its stderr's tail if it fails."""
    done = subprocess.run([python, __file__, *argv], capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{python} {Path(__file__).name} {' '.join(argv)} exited {done.returncode}: "
                           f"{done.stderr[-2000:]}\n(is litdata installed for that Python? see its --help)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def convert_with(python: str, tars: Path, out: Path, chunks: int, workers: int) -> dict[str, Any]:
    """The tars under ``tars`` converted to LitData chunks under ``out``: seconds, samples, bytes, files."""
    return _run(python, "convert", str(tars), str(out), "--chunks", str(chunks), "--workers", str(workers))


def read_rate_with(python: str, data: Path, args: Any) -> dict[str, Any]:
    """Images/s of LitData reading ``data`` with in_place.py's ``args`` (workers, batch, image size, batches)."""
    return _run(python, "read", str(data), "--workers", str(args.workers), "--batch-size", str(args.batch_size),
                "--image-size", str(args.image_size), "--warmup", str(args.warmup), "--batches", str(args.batches))


# ---- the conversion, in LitData's venv -----------------------------------------------------------

def tar_samples(tar_path: str) -> Iterator[dict[str, Any]]:
    """The samples of one img2dataset tar, ``{"jpg": bytes, "txt": str}``, members grouped by key in tar order."""
    sample: dict[str, Any] = {}
    key = None
    with tarfile.open(tar_path) as tar:
        for member in tar:
            stem, _, ext = member.name.rpartition(".")
            if stem != key and sample:
                yield sample
                sample = {}
            key = stem
            if ext in ("jpg", "txt"):
                data = tar.extractfile(member).read()
                sample[ext] = data if ext == "jpg" else data.decode()
    if sample:
        yield sample


def convert(args: argparse.Namespace) -> dict[str, Any]:
    from litdata import optimize

    tars = sorted(str(p) for p in Path(args.tars).glob("*.tar"))
    if not tars:
        raise SystemExit(f"no *.tar under {args.tars}: pass the folder of img2dataset tars")
    chunk_bytes = sum(Path(t).stat().st_size for t in tars) // args.chunks + 1
    started = time.perf_counter()
    optimize(fn=tar_samples, inputs=tars, output_dir=args.out, chunk_bytes=chunk_bytes, num_workers=args.workers,
             verbose=False)
    seconds = time.perf_counter() - started
    files = [p for p in Path(args.out).rglob("*") if p.is_file()]
    index = json.loads((Path(args.out) / "index.json").read_text())
    return {"seconds": seconds, "samples": sum(c["chunk_size"] for c in index["chunks"]),
            "chunks": len(index["chunks"]), "bytes": sum(p.stat().st_size for p in files), "files": len(files)}


# ---- the read, in LitData's venv -----------------------------------------------------------------

class ImageTextJob:
    """in_place.py's image-text work on one LitData item: crop-window decode, resize + flip, the caption's UTF-8
    bytes padded to 77. A generator per worker process, made on first use."""

    def __init__(self, image_size: int) -> None:
        self.image_size, self.rng = image_size, None

    def __call__(self, item: dict[str, Any]) -> tuple:
        import numpy as np

        from stoker.producer.images.augment import decode_train_crop, resize_flip_into

        if self.rng is None:
            self.rng = np.random.default_rng()
        image = np.empty((self.image_size, self.image_size, 3), np.uint8)
        resize_flip_into(decode_train_crop(item["jpg"], self.rng), self.image_size, self.rng, image)
        data = item["txt"].encode("utf-8", "replace")
        n = min(len(data), TEXT_LENGTH)
        while n < len(data) and n and data[n] & 0xC0 == 0x80:  # utf8_into's cut: never inside a character
            n -= 1
        text = np.zeros(TEXT_LENGTH, np.uint8)
        text[:n] = np.frombuffer(data, np.uint8, n)
        return image, text, n


def stoker_images_importable() -> None:
    """``stoker.producer.images`` importable from this checkout without installing Stoker here: ``stoker`` is a
    namespace whose one folder is the repository (setup.py maps ``stoker.producer`` to ``producer/``)."""
    import types

    if "stoker" not in sys.modules:
        package = types.ModuleType("stoker")
        package.__path__ = [str(REPOSITORY)]
        sys.modules["stoker"] = package


def read(args: argparse.Namespace) -> dict[str, Any]:
    import litdata
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    from stoker.producer.images.augment import CROP_DECODING

    dataset = StreamingDataset(args.data, shuffle=True, transform=ImageTextJob(args.image_size))
    loader = StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, drop_last=True,
                                 persistent_workers=args.workers > 0)
    epochs = 0

    def batches() -> Iterator[Any]:
        nonlocal epochs
        while True:
            epochs += 1
            yield from loader

    stream = batches()
    for _ in range(args.warmup):
        images, texts, _lengths = next(stream)
        assert tuple(images.shape) == (args.batch_size, args.image_size, args.image_size, 3), images.shape
        assert tuple(texts.shape) == (args.batch_size, TEXT_LENGTH), texts.shape
    started, samples = time.perf_counter(), 0
    for _ in range(args.batches):
        samples += len(next(stream)[2])
    seconds = time.perf_counter() - started
    return {"images_per_s": samples / seconds, "samples": samples, "seconds": seconds, "epochs_started": epochs,
            "litdata": litdata.__version__, "torch": torch.__version__, "crop_decoding": CROP_DECODING}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to_chunks = commands.add_parser("convert", help="img2dataset tars to LitData chunks, once")
    to_chunks.add_argument("tars", help="the folder of *.tar")
    to_chunks.add_argument("out", help="the folder the chunks and index.json are written to (new or empty)")
    to_chunks.add_argument("--chunks", type=int, default=4, help="about this many chunks (one per tar)")
    to_chunks.add_argument("--workers", type=int, default=2, help="optimize's worker processes")
    reading = commands.add_parser("read", help="images/s of a StreamingDataLoader doing the image-text job")
    reading.add_argument("data", help="the folder convert wrote")
    reading.add_argument("--workers", type=int, default=2)
    reading.add_argument("--batch-size", type=int, default=32)
    reading.add_argument("--image-size", type=int, default=128)
    reading.add_argument("--warmup", type=int, default=20)
    reading.add_argument("--batches", type=int, default=250)
    args = parser.parse_args()
    stoker_images_importable()
    print(json.dumps(convert(args) if args.command == "convert" else read(args)), flush=True)


if __name__ == "__main__":
    main()
