#!/usr/bin/env python3
"""Stoker against its peers on the reference job, same machine, same cores, same run.

Job: encoded ~95 KB JPEGs -> decode -> random-resized-crop 224 (scale 0.08-1, ratio
3/4-4/3) -> random flip -> batches of 64 uint8 + int32 labels.

- stoker: `stoker produce --workers 2` delivering to this process over TCP;
- tf.data: TFRecord of the same JPEGs, map(decode_and_crop_jpeg with
  sample_distorted_bounding_box, resize, flip, num_parallel_calls=AUTOTUNE),
  batch 64, prefetch(AUTOTUNE), consumed in this process;
- tensorpack 0.11: MultiProcessRunnerZMQ(2 procs) + send_dataflow_zmq -> RemoteDataZMQ,
  if --tensorpack-python points at a venv where it is installed (see docs/performance.md).

Run:  python benchmarks/peers.py [--tensorpack-python /tmp/tpvenv/bin/python]   (table + JSON)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from delivery import producer_delivery  # noqa: E402
from harness import add_out_argument, benchmark_parser, synthetic_lmdb, write_results  # noqa: E402
from stoker.producer.dataset.sources.lmdb_dataset import LmdbDataset  # noqa: E402


def write_tfrecord(lmdb_path: Path, out: Path) -> None:
    with LmdbDataset(lmdb_path) as ds, tf.io.TFRecordWriter(str(out)) as writer:
        for i in range(len(ds)):
            record = ds.read(i)
            label, data = record["label"], record["image"]
            example = tf.train.Example(features=tf.train.Features(feature={
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}))
            writer.write(example.SerializeToString())


def tf_data_rate(record_file: Path, batch: int, size: int, warmup: int, batches: int) -> float:
    features = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(serialized: tf.Tensor):
        ex = tf.io.parse_single_example(serialized, features)
        shape = tf.io.extract_jpeg_shape(ex["image"])
        begin, crop, _ = tf.image.sample_distorted_bounding_box(
            shape, tf.zeros([0, 0, 4]), area_range=(0.08, 1.0), aspect_ratio_range=(3 / 4, 4 / 3),
            max_attempts=10, use_image_if_no_bounding_boxes=True)
        window = tf.stack([begin[0], begin[1], crop[0], crop[1]])
        image = tf.io.decode_and_crop_jpeg(ex["image"], window, channels=3)
        image = tf.cast(tf.image.resize(image, [size, size]), tf.uint8)
        return tf.image.random_flip_left_right(image), tf.cast(ex["label"], tf.int32)

    ds = (tf.data.TFRecordDataset(str(record_file)).repeat().map(parse, num_parallel_calls=tf.data.AUTOTUNE)
          .batch(batch).prefetch(tf.data.AUTOTUNE))
    it = iter(ds)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        images, labels = next(it)
    images.numpy()
    return batches * batch / (time.perf_counter() - t0)


def tensorpack_rate(python: str, lmdb_path: Path, batches: int) -> float | None:
    script = Path(__file__).parent / "peer_tensorpack.py"
    try:
        out = subprocess.run([python, str(script), str(lmdb_path), "--procs", "2", "--batches", str(batches)],
                             capture_output=True, text=True, timeout=400, start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"tensorpack run failed: {exc}")
        return None
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)["images_per_s"]
    print("tensorpack run failed:\n" + out.stderr[-2000:])
    return None


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tensorpack-python", default=None, help="python of a venv with tensorpack 0.11 + stoker")
    add_out_argument(parser, "peers.json")
    args = parser.parse_args()
    batch, size = 64, 224
    with synthetic_lmdb(args.records) as lmdb_path:
        record_file = lmdb_path.parent / "bench.tfrecord"
        write_tfrecord(lmdb_path, record_file)
        stoker_rate, _ = producer_delivery(lmdb_path, 2, batch, size, args.warmup, args.batches)  # images/s, cores
        rates = {"stoker (2 workers, another process)": stoker_rate,
                 "tf.data (AUTOTUNE, in process)": tf_data_rate(record_file, batch, size, args.warmup, args.batches)}
        if args.tensorpack_python:
            tp = tensorpack_rate(args.tensorpack_python, lmdb_path, args.batches)
            if tp is not None:
                rates["tensorpack 0.11 (2 procs, ZMQ)"] = tp
    stoker = rates["stoker (2 workers, another process)"]
    print(f"reference job, {os.cpu_count()} cores, batch {batch} x {size}px:")
    print(f"{'pipeline':<38} | {'images/s':>8} | {'stoker / it':>11}")
    print("-" * 64)
    for name, rate in rates.items():
        print(f"{name:<38} | {rate:>8.0f} | {stoker / rate:>11.2f}")
    if not args.tensorpack_python:
        print("tensorpack: not run (pass --tensorpack-python; see docs/performance.md)")
    write_results(args.out, {"benchmark": "peers", "images_per_s": rates,
                             "stoker_ratio": {k: stoker / v for k, v in rates.items()}})


if __name__ == "__main__":
    main()
