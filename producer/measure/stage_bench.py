"""Each producer stage on its own, in one process and thread (like tensorpack's TestDataSpeed).

``measure_stages`` reads real records from any dataset ``stoker produce --data`` serves (an LMDB, a sharded
dataset, a tar or Parquet index, local or in object storage) and times read (the source + record
decoding), the pipeline (split into decode and augment when the pipeline reports
its decoding time, as the built-ins do) and serialize separately, so the slowest
stage is visible; "pipeline" is all of them back to back on one core: the
ceiling of one worker. Records the workers would skip are skipped and counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import cv2
import numpy as np

from stoker.protocol import encode_batch

from stoker.producer.serve.batch_slots import SlotLayout, sample_rows
from stoker.producer.dataset.sources import DatasetError, RecordError, open_dataset
from stoker.producer.pipeline import SampleError, load_pipeline
from stoker.producer.serve.sharding import RecordRng


@dataclass(frozen=True)
class StageRates:
    """Samples/s of each stage alone on one core (decode/augment: None when the pipeline does not split them)."""

    read: float
    decode: Optional[float]
    augment: float
    serialize: float
    pipeline: float
    skipped: int = 0  # records left out because they are corrupt or undecodable, as workers skip them
    pipeline_name: str = "imagenet"
    sample_bytes: int = 0  # one sample's arrays as the pipeline makes them (what the wire carries per sample)

    def as_dict(self) -> dict:
        return {"read": self.read, "decode": self.decode, "augment": self.augment, "serialize": self.serialize,
                "pipeline": self.pipeline, "skipped": self.skipped, "pipeline_name": self.pipeline_name,
                "sample_bytes": self.sample_bytes}

    def table(self) -> str:
        rows = [("read", self.read), ("decode", self.decode), ("augment", self.augment), ("serialize", self.serialize)]
        if self.decode is None:  # the user's function as a whole
            rows = [("read", self.read), (f"{self.pipeline_name}", self.augment), ("serialize", self.serialize)]
        measured = [(n, v) for n, v in rows if v is not None]
        slowest = min(measured, key=lambda r: r[1])[0]
        lines = [f"{'stage':<12} | {'samples/s (1 core)':>18}", "-" * 33]
        lines += [f"{n:<12} | {v:>18.0f}{'  <- slowest' if n == slowest else ''}" for n, v in measured]
        lines.append(f"{'all (1 core)':<12} | {self.pipeline:>18.0f}")
        if self.skipped:
            lines.append(f"({self.skipped} corrupt or undecodable records skipped, as the workers skip them)")
        return "\n".join(lines)


def _rate(fn: Callable[[int], object], items: int, seconds: float) -> tuple[float, float]:
    """``(calls/s, seconds measured)`` calling ``fn(i % items)`` for about ``seconds``."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn(n % items)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n / elapsed, elapsed


def measure_stages(location: str, image_size: int = 224, batch_size: int = 64, seconds: float = 2.0,
                   records: int = 128, pipeline: str = "imagenet", pipeline_args: Mapping[str, str] | None = None,
                   mode: str = "train") -> StageRates:
    """Time each stage for about ``seconds`` on up to ``records`` records of the dataset at ``location``
    (``open_dataset``: DatasetError naming what is wrong)."""
    cv2.setNumThreads(1)
    made = load_pipeline(pipeline, pipeline_args, {"mode": mode, "image_size": image_size})
    layout = SlotLayout(made.batch_arrays(), batch_size, slots=1)
    arrays = layout.views(bytearray(layout.slot_bytes))[0]
    row = sample_rows(arrays)[0]
    rngs = RecordRng(0)
    with open_dataset(location) as ds:
        raw, good, skipped = [], [], 0
        for index in range(min(records, len(ds))):
            try:
                record = ds.read(index)
                made.write(record, rngs.for_record(0, index), row)
            except (RecordError, SampleError):
                skipped += 1
                continue
            raw.append(record)
            good.append(index)
        if not raw:
            raise DatasetError(f"none of the first {skipped} records of {location} makes a sample; nothing to measure")
        count = len(raw)
        read, _ = _rate(lambda i: ds.read(good[i]), count, seconds)
    if made.stage_times is not None:
        made.stage_times()  # reset
    transform, elapsed = _rate(lambda i: made.write(raw[i], rngs.for_record(1, good[i]), row), count, seconds)
    decode = augment = None
    if made.stage_times is not None:
        decode_s = made.stage_times().get("decode", 0.0)
        calls = transform * elapsed
        if 0 < decode_s < elapsed:
            decode, augment = calls / decode_s, calls / (elapsed - decode_s)
    serialize = batch_size * _rate(lambda i: encode_batch(arrays, producer="bench", seq=i), 1, seconds)[0]
    ceiling = 1.0 / (1.0 / read + 1.0 / transform + 1.0 / serialize)
    return StageRates(read=read, decode=decode, augment=augment if augment is not None else transform,
                      serialize=serialize, pipeline=ceiling, skipped=skipped, pipeline_name=made.name,
                      sample_bytes=sum(a.nbytes for a in arrays.values()) // batch_size)
