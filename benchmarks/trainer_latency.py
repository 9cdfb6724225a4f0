#!/usr/bin/env python3
"""Latency hiding on the trainer: one tf.function step fed three ways, in one run.

1. constant: the batch is a constant in the graph (training alone: the ceiling);
2. zmq: ZMQInput from a `stoker produce --repeat-batches` daemon in another process,
   serving pre-decoded batches as fast as it can (training plus every copy:
   receive, decode, copy into TF, FIFOQueue, StagingArea);
3. feed_dict-style: the training process itself decodes and augments each batch
   with OpenCV (one thread) and passes numpy arrays to the step.

Two steps: `small-cnn` (three strided convolutions) and `linear` (global average
pool + dense: almost free, so any input cost shows). Mean step time of each, and
the ratios zmq/constant (copies hidden => ~1.0) and feed_dict/zmq.

Run:  python benchmarks/trainer_latency.py [--steps 30]   (table + JSON)
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from harness import (add_out_argument, benchmark_parser, launch_producer, mean_step_seconds,  # noqa: E402
                     producer_flags, synthetic_lmdb, write_results)
from stoker.consumer import ZMQInput  # noqa: E402
from stoker.consumer.train.models import build_model  # noqa: E402
from stoker.producer.images.augment import decode_train_crop, resize_flip_into  # noqa: E402
from stoker.producer.dataset.sources.lmdb_dataset import LmdbDataset  # noqa: E402


def make_model(name: str, size: int, classes: int) -> tf.keras.Model:
    if name == "linear":
        inputs = tf.keras.Input((size, size, 3), dtype="uint8")
        x = tf.keras.layers.Rescaling(1 / 127.5, offset=-1.0)(inputs)
        x = tf.keras.layers.GlobalAveragePooling2D()(x)
        return tf.keras.Model(inputs, tf.keras.layers.Dense(classes)(x))
    return build_model(name, size, classes)


def make_train_step(model: tf.keras.Model):
    optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return train


def run_model(name: str, lmdb_path: Path, batch: int, size: int, steps: int, warmup: int, rounds: int) -> dict:
    """Best of ``rounds`` interleaved measurements of each way in: a slow spell on a shared VM
    then hits all three alike instead of skewing one ratio."""
    classes = 10
    rng = np.random.default_rng(0)
    const_images = tf.constant(rng.integers(0, 255, (batch, size, size, 3), dtype=np.uint8))
    const_labels = tf.constant(np.arange(batch, dtype=np.int32) % classes)
    train = make_train_step(make_model(name, size, classes))
    constant_step = tf.function(lambda: train(const_images, const_labels))

    producer_args = producer_flags(batch, size, repeat_batches=True)
    zmq_train = make_train_step(make_model(name, size, classes))

    def zmq_time() -> tuple[float, float]:
        # A producer and input per round, closed after: idle, they would still wake the CPU meanwhile.
        with launch_producer(lmdb_path, producer_args) as producer, \
                ZMQInput([producer.endpoint], batch_size=batch, image_shape=(size, size, 3), recv_timeout=60) as inp:
            @tf.function
            def zmq_step() -> tf.Tensor:
                images, labels = inp.get()
                return zmq_train(images, labels)

            return mean_step_seconds(zmq_step, steps, warmup), inp.stats.mean_queue_occupancy

    cv2.setNumThreads(1)
    with LmdbDataset(lmdb_path) as ds:
        raw = [(r["label"], r["image"]) for r in (ds.read(i) for i in range(len(ds)))]
    feed_train = tf.function(make_train_step(make_model(name, size, classes)))
    out = np.empty((batch, size, size, 3), np.uint8)
    labels = np.empty(batch, np.int32)
    counter = [0]

    def feed_dict_step() -> tf.Tensor:
        for i in range(batch):
            label, data = raw[counter[0] % len(raw)]
            counter[0] += 1
            resize_flip_into(decode_train_crop(data, rng), size, rng, out[i])
            labels[i] = label
        return feed_train(out, labels)

    t_const, t_zmq, t_feed, occupancy = [], [], [], []
    for _ in range(rounds):
        t_const.append(mean_step_seconds(constant_step, steps, warmup))
        zmq_s, occ = zmq_time()
        t_zmq.append(zmq_s)
        occupancy.append(occ)
        t_feed.append(mean_step_seconds(feed_dict_step, steps, warmup))
    best_const, best_zmq, best_feed = min(t_const), min(t_zmq), min(t_feed)
    return {"model": name, "constant_s": best_const, "zmq_s": best_zmq, "feed_dict_s": best_feed,
            "zmq_over_constant": best_zmq / best_const, "feed_dict_over_zmq": best_feed / best_zmq,
            "zmq_mean_queue_occupancy": occupancy[t_zmq.index(best_zmq)],
            "rounds": {"constant_s": t_const, "zmq_s": t_zmq, "feed_dict_s": t_feed}}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", default="small-cnn,linear")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is kept")
    add_out_argument(parser, "trainer_latency.json")
    args = parser.parse_args()
    with synthetic_lmdb(256) as lmdb_path:
        rows = [run_model(m, lmdb_path, args.batch_size, args.image_size, args.steps, args.warmup, args.rounds)
                for m in args.models.split(",")]
    print(f"step time, batch {args.batch_size} x {args.image_size}px, {args.steps} steps, best of {args.rounds} "
          f"interleaved rounds, CPU ({os.cpu_count()} cores):")
    print(f"{'model':<10} | {'constant':>9} | {'ZMQInput':>9} | {'feed_dict':>9} | {'zmq/const':>9} | {'feed/zmq':>8} | queue")
    print("-" * 80)
    for r in rows:
        print(f"{r['model']:<10} | {1000 * r['constant_s']:>7.1f}ms | {1000 * r['zmq_s']:>7.1f}ms | "
              f"{1000 * r['feed_dict_s']:>7.1f}ms | {r['zmq_over_constant']:>9.3f} | {r['feed_dict_over_zmq']:>8.2f} | "
              f"{r['zmq_mean_queue_occupancy']:.2f}")
    write_results(args.out, {"benchmark": "trainer_latency", "rows": rows, "batch_size": args.batch_size,
                             "image_size": args.image_size, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
