"""Pipelines through real producer processes, sockets and ZMQInput: user code, detection, segmentation."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from stoker.consumer import InputTimeoutError, ZMQInput
from stoker.producer.dataset.sources import LmdbDataset
from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.process import ProducerProcess
from stoker.producer.dataset.build.synthetic import build_synthetic, synthetic_record

pytestmark = pytest.mark.timeout(240)

FAULTY = Path(__file__).parents[1] / "pipelines" / "faulty_pipeline.py"


@pytest.fixture(scope="module")
def ids_lmdb(tmp_path_factory) -> Path:
    """40 classification records with an ``id`` field the faulty pipeline keys its faults on."""
    path = tmp_path_factory.mktemp("ids") / "ds"
    records = ({**synthetic_record("classification", 3, i, 4), "id": i} for i in range(40))
    write_lmdb(path, records, classes=[f"c{k}" for k in range(4)], progress=False)
    return path


def _epoch_zero(inp: ZMQInput, expected: set[int], limit: int = 200, more: int = 10) -> Counter:
    """Record indices of epoch 0 received: read until all ``expected`` came (each worker ends its share
    of the epoch on its own), then ``more`` batches in which a repeat would show."""
    seen: Counter = Counter()
    for _ in range(limit):
        batch = inp.get()
        for index, epoch in zip(batch["index"].numpy(), batch["epoch"].numpy()):
            if epoch == 0:
                seen[int(index)] += 1
        if set(seen) >= expected:
            if more == 0:
                return seen
            more -= 1
    raise AssertionError(f"epoch 0 incomplete after {limit} batches: missing {sorted(expected - set(seen))}")


def test_user_code_that_raises_or_returns_the_wrong_thing_costs_only_its_records(ids_lmdb):
    faults = {3: "raise", 11: "dtype", 17: "shape", 29: "boxes"}
    args = ["--workers", "2", "--batch-size", "4", "--mode", "eval", "--seed", "1", "--pipeline", f"{FAULTY}:make_pipeline",
            "--pipeline-arg", "size=24", "--pipeline-arg", "faults=" + ",".join(f"{k}@{i}" for i, k in faults.items())]
    with ProducerProcess(ids_lmdb, extra_args=args) as producer:
        with ZMQInput([producer.endpoint], recv_timeout=30) as inp:  # the spec is learned from the first batch
            assert inp.spec.names == ("images", "labels", "boxes", "boxes_len", "index", "epoch")
            seen = _epoch_zero(inp, set(range(40)) - set(faults))
            images, labels, boxes = inp.get()  # unpacks to the pipeline's own fields
            assert images.shape == (4, 24, 24, 3) and boxes.shape == (4, 4, 4)
        assert producer.proc.poll() is None, "the daemon died of user code"
        assert producer.stop() == 0
    assert set(seen) == set(range(40)) - set(faults) and set(seen.values()) == {1}
    log = producer.log_text()
    expected = {
        3: "the pipeline's sample function raised RuntimeError: user bug on purpose",
        11: "field 'images' is float32, the pipeline declares uint8",
        17: "field 'images' has shape [24, 12, 3], the pipeline declares [24, 24, 3]",
        29: "field 'boxes' has 5 rows, more than the 4 declared (upto(4))",
    }
    for index, message in expected.items():
        assert f"skipping record {index:08d}: {message}" in log, f"record {index} not named:\n{log[-3000:]}"
    assert producer.counters()[2] >= len(faults)


@pytest.mark.parametrize("args, message", [
    (["--pipeline", "no_such_module_at_all:make"], "cannot import no_such_module_at_all"),
    (["--pipeline", f"{FAULTY}:make_pipeline", "--pipeline-arg", "size=large"], "size=large: .* expects int"),
    (["--pipeline", f"{FAULTY}:make_pipeline", "--pipeline-arg", "colour=red"], "takes size, faults"),
    (["--pipeline", "detection", "--pipeline-arg", "max_boxes"], "expected KEY=VALUE"),
])
def test_a_pipeline_that_cannot_be_loaded_stops_the_daemon_at_start_with_the_reason(ids_lmdb, args, message):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "produce", "--lmdb", str(ids_lmdb),
                          "--bind", "tcp://127.0.0.1:*", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert __import__("re").search(message, out.stderr), out.stderr


@pytest.fixture(scope="module")
def detection_lmdb(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("det") / "ds"
    build_synthetic(path, 48, seed=5, num_classes=3, task="detection", progress=False)
    return path


def test_detection_from_write_lmdb_through_two_producers_to_keras_fit_with_boxes(tmp_path):
    path = tmp_path / "det"
    report = write_lmdb(path, (synthetic_record("detection", 9, i, 3) for i in range(32)), task="detection",
                        progress=False)
    assert report.meta.count == 32 and not report.skipped
    args = ["--workers", "1", "--batch-size", "4", "--pipeline", "detection", "--image-size", "64",
            "--pipeline-arg", "max_boxes=8", "--seed", "2"]
    with ProducerProcess(path, extra_args=[*args, "--shard", "0/2"]) as p0, \
            ProducerProcess(path, extra_args=[*args, "--shard", "1/2"]) as p1, \
            ZMQInput([p0.endpoint, p1.endpoint], recv_timeout=30) as inp:
        assert inp.spec["boxes"].shape == (4, 8, 4) and inp.spec["classes"].dtype == "int32"

        def to_targets(images, y):
            boxes, boxes_len = y
            mask = tf.sequence_mask(boxes_len, 8, dtype=tf.float32)[..., None]
            return images, tf.reduce_sum(boxes * mask, axis=1) / tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)

        inputs = tf.keras.Input((64, 64, 3), dtype="uint8")
        x = tf.keras.layers.Rescaling(1 / 255)(inputs)
        x = tf.keras.layers.Conv2D(8, 3, strides=4, activation="relu")(x)
        outputs = tf.keras.layers.Dense(4)(tf.keras.layers.GlobalAveragePooling2D()(x))  # the mean box, as a toy
        model = tf.keras.Model(inputs, outputs)
        model.compile("adam", "mse")
        dataset = inp.as_dataset(x="images", y=("boxes", "boxes_len")).map(to_targets)
        history = model.fit(dataset, steps_per_epoch=4, epochs=2, verbose=0, callbacks=[inp.keras_callback()])
        assert np.isfinite(history.history["loss"]).all()
        # Both producers feed it, but the first one up may fill the queue before the second sends
        # anything: take batches until the second has been heard from, bounded.
        deadline = time.monotonic() + 60
        while len(inp.stats.per_producer) < 2:
            assert time.monotonic() < deadline, f"only {inp.stats.per_producer} sent batches"
            inp.get()
        batch = inp.get()
        n = batch["boxes_len"].numpy()
        assert (n >= 1).all() and (n == batch["classes_len"].numpy()).all()
        boxes = batch["boxes"].numpy()
        for row, count in enumerate(n):
            assert (boxes[row, :count, 2] > boxes[row, :count, 0]).all() and boxes[row, :count].max() <= 64
            assert (boxes[row, count:] == 0).all()


def test_segmentation_batches_reach_a_custom_loop_with_masks_that_fit_the_images(tmp_path):
    path = tmp_path / "seg"
    build_synthetic(path, 16, seed=4, num_classes=3, task="segmentation", progress=False)
    args = ["--workers", "1", "--batch-size", "2", "--pipeline", "segmentation", "--pipeline-arg", "size=48x64"]
    with ProducerProcess(path, extra_args=args) as producer, ZMQInput([producer.endpoint], recv_timeout=30) as inp:
        @tf.function
        def step():
            images, masks = inp.get()
            return tf.shape(images), tf.reduce_max(masks), masks

        shape, top, masks = step()
        assert shape.numpy().tolist() == [2, 48, 64, 3] and 1 <= int(top) <= 3 and masks.dtype == tf.uint8


def test_a_producer_running_another_pipeline_is_rejected_naming_both_specs(detection_lmdb, synth_lmdb):
    with ProducerProcess(synth_lmdb, extra_args=["--workers", "1", "--batch-size", "4", "--image-size", "64"]) as cls, \
            ProducerProcess(detection_lmdb, extra_args=["--workers", "1", "--batch-size", "4", "--pipeline",
                                                        "detection", "--image-size", "64"]) as det:
        with ZMQInput([cls.endpoint, det.endpoint], batch_size=4, image_shape=(64, 64, 3), recv_timeout=30) as inp:
            for _ in range(5):
                inp.get()
            deadline = 200
            while inp.stats.mismatched_batches == 0 and deadline:
                inp.get()
                deadline -= 1
            stats = inp.stats
        assert stats.mismatched_batches >= 1 and len(stats.per_producer) == 1  # only the imagenet producer's
        assert "sends images uint8 [4, 64, 64, 3], boxes float32 [4, 100, 4]" in stats.last_error
        assert "this trainer expects images uint8 [4, 64, 64, 3], labels int32 [4], index int64 [4]" in stats.last_error
        assert "lack labels" in stats.last_error


def test_without_a_spec_the_trainer_says_it_waited_for_a_first_batch():
    with pytest.raises(InputTimeoutError, match="no batch spec was given, so the trainer waited for a first batch"):
        ZMQInput(["tcp://127.0.0.1:1"], recv_timeout=1)


def test_tf1_graph_dequeue_names_a_detection_batch(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "lmdb", "synth", str(tmp_path / "det"), "--task",
                          "detection", "--count", "12", "--classes", "3", "--quiet"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "wrote 12 synthetic detection records" in out.stdout, out.stderr
    args = ["--workers", "1", "--batch-size", "3", "--pipeline", "detection", "--image-size", "32",
            "--pipeline-arg", "max_boxes=6", "--mode", "eval"]
    with ProducerProcess(tmp_path / "det", extra_args=args) as producer:
        with tf.Graph().as_default():
            inp = ZMQInput([producer.endpoint], recv_timeout=30)
            batch = inp.dequeue()
            boxes_per_image = tf.reduce_sum(tf.cast(tf.reduce_any(batch["boxes"] > 0, axis=2), tf.int32), axis=1)
            with tf.compat.v1.Session() as sess:
                inp.start(sess)
                counted, lengths, index = sess.run([boxes_per_image, batch["boxes_len"], batch["index"]])
                inp.close()
    assert counted.tolist() == lengths.tolist() and len(set(index.tolist())) == 3


def test_bench_producer_times_the_stages_of_any_pipeline(detection_lmdb):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "bench", "producer", "--lmdb", str(detection_lmdb),
                          "--pipeline", "detection", "--image-size", "64", "--seconds", "0.2", "--batch-size", "4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for stage in ("read", "decode", "augment", "serialize", "all (1 core)"):
        assert stage in out.stdout
    user = subprocess.run([sys.executable, "-m", "stoker.cli.main", "bench", "producer", "--lmdb", str(detection_lmdb),
                           "--pipeline", f"{FAULTY}:make_pipeline", "--seconds", "0.2", "--batch-size", "4"],
                          capture_output=True, text=True, timeout=120)
    # the faulty pipeline reads fields this dataset lacks: every record is skipped and the bench says so
    assert user.returncode == 2 and "none of the first" in user.stderr and "makes a sample" in user.stderr
