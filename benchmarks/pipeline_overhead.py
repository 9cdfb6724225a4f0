#!/usr/bin/env python3
"""What the pipeline interface costs the imagenet path: today's worker loop vs the one before it.

Both loops make whole batches of samples from the same LMDB records, in this process, one
thread (OpenCV single-threaded), exactly as a worker's inner loop does:

- baseline: the producer's inner loop before pipelines existed, copied here verbatim: read
  the record (msgpack + label/image checks), decode the crop window, resize + flip into the
  batch row, write label, index and epoch; one generator per batch;
- pipeline: the current worker's loop: ``LmdbDataset.read`` (schema-checked dict), a
  per-record ``RecordRng``, ``Pipeline.write`` of the built-in imagenet pipeline into the
  sample's row of the batch, index and epoch.

Interleaved rounds, best of each kept (shared VMs drift). Target: pipeline / baseline >= 0.97.
Prints a table and writes JSON (default benchmarks/results/pipeline_overhead.json).
Run:  python benchmarks/pipeline_overhead.py [--records 256] [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import time
from pathlib import Path

import cv2
import lmdb
import msgpack
import numpy as np

from harness import add_out_argument, benchmark_parser, machine_info, synthetic_lmdb, write_results
from stoker.producer.images.augment import decode_rgb, decode_train_crop, eval_transform, resize_flip_into
from stoker.producer.serve.batch_slots import SlotLayout, sample_rows
from stoker.producer.dataset.sources import LmdbDataset, record_key
from stoker.producer.pipeline import load_pipeline
from stoker.producer.serve.sharding import RecordRng

BATCH = 64


def baseline(lmdb_path: Path, size: int, train: bool, seconds: float) -> float:
    """Samples/s of the pre-pipeline worker loop (producer/serve/worker.py before the pipeline interface)."""
    with LmdbDataset(lmdb_path) as ds:
        count = len(ds)
    env = lmdb.open(str(lmdb_path), readonly=True, lock=False, readahead=False, meminit=False)
    images = np.empty((BATCH, size, size, 3), np.uint8)
    labels, indices, epochs = np.empty(BATCH, np.int32), np.empty(BATCH, np.int64), np.empty(BATCH, np.int32)

    def read(index: int) -> tuple[int, bytes]:  # the old dataset_format.decode_record, checks included
        key = record_key(index)
        with env.begin(buffers=False) as txn:
            value = txn.get(key)
        record = msgpack.unpackb(value, raw=False, strict_map_key=True)
        label, image = record.get("label"), record.get("image")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 10:
            raise ValueError(key)
        if not isinstance(image, bytes) or not image:
            raise ValueError(key)
        return label, image

    n, batch_no, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        rng = np.random.default_rng([0, 0, batch_no])
        for filled in range(BATCH):
            index = n % count
            label, data = read(index)
            pixels = decode_train_crop(data, rng) if train else decode_rgb(data)
            if train:
                resize_flip_into(pixels, size, rng, images[filled])
            else:
                eval_transform(pixels, size, images[filled])
            labels[filled], indices[filled], epochs[filled] = label, index, 0
            n += 1
        batch_no += 1
    env.close()
    return n / (time.perf_counter() - t0)


def with_pipeline(lmdb_path: Path, size: int, train: bool, seconds: float) -> float:
    """Samples/s of the current worker loop with the built-in imagenet pipeline."""
    pipeline = load_pipeline("imagenet", {}, {"mode": "train" if train else "eval", "image_size": size})
    layout = SlotLayout(pipeline.batch_arrays(), BATCH, slots=1)
    arrays = layout.views(bytearray(layout.slot_bytes))[0]
    rows = sample_rows(arrays)
    indices, epochs = arrays["index"], arrays["epoch"]
    rngs = RecordRng(0)
    with LmdbDataset(lmdb_path) as ds:
        count = len(ds)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for filled in range(BATCH):
                index = n % count
                pipeline.write(ds.read(index), rngs.for_record(0, index), rows[filled])
                indices[filled], epochs[filled] = index, 0
                n += 1
            pipeline.stage_times()
        return n / (time.perf_counter() - t0)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=256, help="synthetic JPEGs (~95 KB, 300-500 px)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is kept")
    add_out_argument(parser, "pipeline_overhead.json")
    args = parser.parse_args()
    cv2.setNumThreads(1)
    rows = []
    with synthetic_lmdb(args.records) as path:
        for train in (True, False):
            base, new = [], []
            for _ in range(args.rounds):
                base.append(baseline(path, args.image_size, train, args.seconds))
                new.append(with_pipeline(path, args.image_size, train, args.seconds))
            rows.append({"mode": "train" if train else "eval", "baseline_samples_per_s": max(base),
                         "pipeline_samples_per_s": max(new), "ratio": max(new) / max(base),
                         "rounds": {"baseline": base, "pipeline": new}})
    print(f"imagenet path, one thread, {args.image_size} px, batches of {BATCH}, best of {args.rounds} interleaved rounds")
    print(f"{'mode':>5} | {'baseline samples/s':>18} | {'pipeline samples/s':>18} | {'ratio':>6}")
    print("-" * 58)
    for r in rows:
        print(f"{r['mode']:>5} | {r['baseline_samples_per_s']:>18.0f} | {r['pipeline_samples_per_s']:>18.0f} | "
              f"{r['ratio']:>6.3f}")
    result = {"benchmark": "pipeline_overhead", "rows": rows, "image_size": args.image_size, "batch_size": BATCH,
              **machine_info(), "target_ratio": 0.97}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
