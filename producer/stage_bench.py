"""Each producer stage on its own, in one process and thread (like tensorpack's TestDataSpeed).

``measure_stages`` reads real records from an LMDB and times read, decode (of
the random crop window, as the workers do), augment (resize + flip) and
serialize separately, so the slowest
stage is visible; "pipeline" is all four back to back on one core: the ceiling
of one worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import cv2
import numpy as np

from stoker.protocol import encode_batch

from .augment import DecodeError, decode_train_crop, resize_flip_into
from .dataset_format import DatasetError, LmdbDataset, RecordError


@dataclass(frozen=True)
class StageRates:
    """Images/s of each stage alone on one core."""

    read: float
    decode: float
    augment: float
    serialize: float
    pipeline: float
    skipped: int = 0  # records left out because they are corrupt or undecodable, as workers skip them

    def table(self) -> str:
        rows = [(name, getattr(self, name)) for name in ("read", "decode", "augment", "serialize", "pipeline")]
        slowest = min(rows[:4], key=lambda r: r[1])[0]
        lines = [f"{'stage':<10} | {'images/s (1 core)':>17}", "-" * 30]
        lines += [f"{n:<10} | {v:>17.0f}{'  <- slowest' if n == slowest else ''}" for n, v in rows]
        if self.skipped:
            lines.append(f"({self.skipped} corrupt or undecodable records skipped, as the workers skip them)")
        return "\n".join(lines)


def _rate(fn, items: int, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while True:
        fn(n % items)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n / elapsed


def measure_stages(lmdb_path: str, image_size: int = 224, batch_size: int = 64, seconds: float = 2.0,
                   records: int = 128) -> StageRates:
    """Time each stage for about ``seconds`` on up to ``records`` records of ``lmdb_path``."""
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    with LmdbDataset(lmdb_path) as ds:
        raw, good, skipped = [], [], 0
        for index in range(min(records, len(ds))):
            try:
                data = ds.read(index)[1]
                decode_train_crop(data, rng)
            except (RecordError, DecodeError):
                skipped += 1
                continue
            raw.append(data)
            good.append(index)
        if not raw:
            raise DatasetError(f"none of the first {skipped} records of {lmdb_path} decodes; nothing to measure")
        count = len(raw)
        read = _rate(lambda i: ds.read(good[i]), count, seconds)
    crops = [decode_train_crop(d, rng) for d in raw]
    out = np.empty((image_size, image_size, 3), np.uint8)
    decode = _rate(lambda i: decode_train_crop(raw[i], rng), count, seconds)
    augment = _rate(lambda i: resize_flip_into(crops[i], image_size, rng, out), count, seconds)
    batch = {"images": np.zeros((batch_size, image_size, image_size, 3), np.uint8),
             "labels": np.zeros(batch_size, np.int32)}
    serialize = batch_size * _rate(lambda i: encode_batch(batch, producer="bench", seq=i), 1, seconds)

    def whole(i: int) -> None:
        resize_flip_into(decode_train_crop(raw[i], rng), image_size, rng, out)

    pipeline = 1.0 / (1.0 / read + 1.0 / _rate(whole, count, seconds) + 1.0 / serialize)
    return StageRates(read=read, decode=decode, augment=augment, serialize=serialize, pipeline=pipeline,
                      skipped=skipped)
