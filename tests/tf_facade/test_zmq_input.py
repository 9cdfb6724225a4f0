"""ZMQInput with real producer daemons, real sockets and real TensorFlow."""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

import numpy as np
import pytest
import tensorflow as tf
import zmq

from stoker.consumer import InputClosedError, InputMismatchError, InputTimeoutError, ZMQInput
from stoker.protocol import encode_batch

pytestmark = pytest.mark.timeout(180)

from conftest import CHECKSUM_WEIGHTS as WEIGHTS, EVAL_SIZE as SIZE, stoker_batch, one_worker_producer

BATCH = 8


_producer = functools.partial(one_worker_producer, batch=BATCH, size=SIZE, flags=("--log-interval", "1"))


def _stoker_threads():
    return [t for t in threading.enumerate() if t.name.startswith("stoker-")]


def test_tf_function_loop_gets_every_record_once_per_epoch_from_two_producers(synth_lmdb, record_by_checksum):
    weights = tf.constant(WEIGHTS)
    with _producer(synth_lmdb, "--mode", "eval", "--shard", "0/2", "--seed", "1") as p0, \
            _producer(synth_lmdb, "--mode", "eval", "--shard", "1/2", "--seed", "2") as p1, \
            ZMQInput([p0.endpoint, p1.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=30) as inp:

        @tf.function
        def step():
            images, labels = inp.get()
            checksums = tf.reduce_sum(tf.cast(images, tf.int64) * weights[None], axis=[1, 2, 3])
            return checksums, labels

        results = [step() for _ in range(200)]
        assert inp.stats.protocol_errors == 0 and len(inp.stats.per_producer) == 2
    per_shard = defaultdict(list)
    for checksums, labels in results:
        for checksum, label in zip(checksums.numpy(), labels.numpy()):
            index, true_label = record_by_checksum[int(checksum)]  # KeyError: an image no record produces
            assert label == true_label
            per_shard[index % 2].append(index)
    for shard, stream in per_shard.items():
        shard_records = set(range(shard, 96, 2))
        full_epochs = len(stream) // len(shard_records)
        assert full_epochs >= 1
        for e in range(full_epochs):
            epoch = stream[e * len(shard_records):(e + 1) * len(shard_records)]
            assert sorted(epoch) == sorted(shard_records), f"shard {shard} epoch {e}"


def test_keras_fit_trains_on_as_dataset(synth_lmdb):
    with _producer(synth_lmdb, "--seed", "3") as producer, \
            ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=30) as inp:
        model = tf.keras.Sequential([tf.keras.Input((SIZE, SIZE, 3), dtype="uint8"), tf.keras.layers.Rescaling(1 / 255),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(4)])
        model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(inp.as_dataset(), steps_per_epoch=5, epochs=2, verbose=0,
                            callbacks=[inp.keras_callback(log_every=2)])
        assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
        assert inp.stats.batches >= 10


def test_tf_compat_v1_session_reads_dequeue_tensors(synth_lmdb, record_by_checksum):
    with _producer(synth_lmdb, "--mode", "eval", "--seed", "4") as producer:
        with tf.Graph().as_default():
            inp = ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=30)
            images, labels = inp.dequeue()
            checksums = tf.reduce_sum(tf.cast(images, tf.int64) * tf.constant(WEIGHTS)[None], axis=[1, 2, 3])
            with tf.compat.v1.Session() as sess:
                inp.start(sess)
                for _ in range(5):
                    got_checksums, got_labels = sess.run([checksums, labels])
                    for checksum, label in zip(got_checksums, got_labels):
                        assert record_by_checksum[int(checksum)][1] == label
                inp.close()
    assert not _stoker_threads()


def test_killed_producer_leaves_training_running_and_rejoins_when_restarted(synth_lmdb):
    p0 = _producer(synth_lmdb, "--shard", "0/2")
    p1 = _producer(synth_lmdb, "--shard", "1/2")
    try:
        with ZMQInput([p0.endpoint, p1.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=20,
                      queue_capacity=4) as inp:
            @tf.function
            def step():
                return inp.get()[1]

            def run_until(predicate, limit=400):
                for _ in range(limit):
                    step()
                    if predicate(inp.stats):
                        return True
                return False

            assert run_until(lambda stats: len(stats.per_producer) == 2)
            p0_id = next(i for i in inp.stats.per_producer if "#0/2~" in i)
            p0.kill()
            # Batches p0 wrote before it died still arrive from the kernel's socket buffers, however many
            # they hold. Once libzmq has read up to the closed connection it reports the disconnect; from
            # then on at most what sits in ZMQ's receive pipe (rcvhwm) plus the batch being handled is left.
            assert run_until(lambda stats: p0.endpoint not in stats.connected_endpoints), "disconnect not seen"
            drained_at = inp.stats.per_producer[p0_id]
            for _ in range(60):  # training keeps going on the other producer
                step()
            after_kill = inp.stats.per_producer
            assert after_kill[p0_id] <= drained_at + inp.rcvhwm + 1
            p0 = _producer(synth_lmdb, "--shard", "0/2", bind=p0.endpoint)  # same address, a new instance id
            assert p0.producer_id != p0_id
            assert run_until(lambda stats: stats.per_producer.get(p0.producer_id, 0) > 0), \
                "restarted producer did not rejoin"
    finally:
        p0.stop()
        p1.stop()


def test_producers_sending_another_batch_shape_fail_the_step_with_both_shapes_not_a_hang(synth_lmdb):
    """Batches that can never match keep arriving: the step fails at once with both shapes (not at the timeout)."""
    with _producer(synth_lmdb, batch=16) as producer, \
            ZMQInput([producer.endpoint], batch_size=32, image_shape=(SIZE, SIZE, 3), recv_timeout=3600) as inp:
        safety_net = threading.Timer(60, inp.close)  # without the fix this test fails, it does not hang
        safety_net.start()
        try:
            with pytest.raises(InputMismatchError) as failure:
                inp.get()
        finally:
            safety_net.cancel()
        assert inp.stats.mismatched_batches >= 1 and inp.stats.batches == 0
    message = str(failure.value)
    assert f"every producer at {producer.endpoint} sent batches this trainer can never take" in message
    assert f"sends images uint8 [16, {SIZE}, {SIZE}, 3]" in message
    assert f"expects images uint8 [32, {SIZE}, {SIZE}, 3]" in message
    assert "--batch-size 32" in message and "batch_size=16" in message


def test_no_producer_gives_a_clear_timeout_error_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(InputTimeoutError, match=r"no acceptable batch from any producer at tcp://127.0.0.1:1 "
                                                r".*recv_timeout=1.*nothing arrived: check the producers run"):
        with ZMQInput(["tcp://127.0.0.1:1"], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=1) as inp:
            @tf.function
            def step():
                return inp.get()[1]

            step()
    assert time.monotonic() - t0 < 10
    assert not _stoker_threads()


def test_epochs_on_an_exact_zmq_input_names_what_to_use_instead():
    # TensorFlow takes ZMQInput's batches (get(), as_dataset()): epochs() refuses at once, not at the first batch
    with ZMQInput(["tcp://127.0.0.1:1"], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), exact=True) as inp:
        with pytest.raises(TypeError, match=r"not iterated batch by batch.*consumed_epochs.*BatchStream or TorchInput"):
            inp.epochs()


def test_eager_get_after_producers_vanish_raises_timeout(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        inp = ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=1.5,
                       queue_capacity=2)
        inp.get()
    with pytest.raises(InputTimeoutError, match="recv_timeout=1.5"):
        for _ in range(50):
            inp.get()
    inp.close()


def test_close_returns_promptly_with_threads_gone_even_when_full(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        inp = ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), queue_capacity=2)
        deadline = time.monotonic() + 30
        while inp.queue_size() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the receive thread is now blocked in a full-queue enqueue
        t0 = time.monotonic()
        inp.close()
        assert time.monotonic() - t0 < 10  # about 2 s by contract; the bound tells that from a hang, not load
        assert not _stoker_threads()
        with pytest.raises(InputClosedError):
            inp.get()


def test_batches_of_the_wrong_shape_are_rejected_and_counted_not_fed(synth_lmdb):
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZMQInput([f"tcp://127.0.0.1:{port}"], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=30) as inp:
            wrong = stoker_batch(np.zeros((BATCH, 16, 16, 3), np.uint8), np.zeros(BATCH, np.int32))
            good = stoker_batch(np.full((BATCH, SIZE, SIZE, 3), 7, np.uint8), np.arange(BATCH, dtype=np.int32))
            # get() returns the batch staged before while staging the next, so it needs two good ones.
            for frames in (encode_batch(wrong, producer="p", seq=0), [b"junk"], encode_batch(good, producer="p", seq=1),
                           encode_batch(good, producer="p", seq=2)):
                push.send_multipart(frames)
            images, labels = inp.get()
            assert int(tf.reduce_max(images)) == 7 and labels.numpy().tolist() == list(range(BATCH))
            stats = inp.stats
            assert stats.mismatched_batches == 1 and stats.protocol_errors == 1
            assert "not valid msgpack" in stats.last_error
    finally:
        push.close(0)
        ctx.term()


def test_ctrl_c_stops_stoker_train_promptly_while_it_waits_for_data(tmp_path):
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "stoker.cli.main", "train", "--connect", "tcp://127.0.0.1:1",
                                 "--recv-timeout", "120", "--image-size", "32", "--batch-size", "4", "--steps", "5"],
                                stdout=log_file, stderr=subprocess.STDOUT)
    try:
        # Signal once it waits for data, however long TensorFlow's import and the model build took.
        deadline = time.monotonic() + 120
        while b"waiting for the first batches" not in log_path.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.1)
        # Promptly means not waiting out --recv-timeout (120 s): it must end long before that, and with
        # Ctrl-C's exit code (a timeout exits otherwise). No wall-clock bound tighter than that: shutting
        # TensorFlow down took 2.3 s on a loaded 2-core CI run.
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        assert proc.returncode == 130, log_path.read_text()[-2000:]
    finally:
        proc.kill()
        proc.wait()
