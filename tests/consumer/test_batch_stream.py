"""BatchStream: the receive core as a plain iterator of NumPy dicts, with real producers and no TensorFlow."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest

from stoker.consumer import InputClosedError, InputTimeoutError
from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.exact.state import parse_state
from stoker.producer.process import ProducerProcess
from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import CHECKSUM_WEIGHTS as WEIGHTS, EVAL_SIZE as SIZE, one_worker_producer

pytestmark = pytest.mark.timeout(180)

BATCH = 8


_producer = functools.partial(one_worker_producer, batch=BATCH, size=SIZE)


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_batches_are_owned_aligned_numpy_with_the_eval_transforms_pixels(synth_lmdb, record_by_checksum, receive):
    weights = np.asarray(WEIGHTS, np.int64)
    with _producer(synth_lmdb, "--mode", "eval") as producer, \
            BatchStream([producer.endpoint], recv_timeout=30, receive=receive) as stream:
        assert stream.receive == ("direct" if receive == "auto" else "libzmq")
        kept = []
        for _, batch in zip(range(6), stream):
            images, labels = batch["images"], batch["labels"]
            assert images.shape == (BATCH, SIZE, SIZE, 3) and images.dtype == np.uint8
            assert images.ctypes.data % 64 == 0 and images.flags.c_contiguous and images.flags.writeable
            for image, label in zip(images, labels):
                index, true_label = record_by_checksum[int((image.astype(np.int64) * weights).sum())]
                assert label == true_label and index in batch["index"]
            kept.append((batch, images.copy()))
        for _ in zip(range(6), stream):  # later batches never write into the ones handed out
            pass
        for batch, snapshot in kept:
            assert np.array_equal(batch["images"], snapshot)
        assert stream.stats.batches >= 12 and stream.stats.protocol_errors == 0


def test_no_producer_ends_the_iteration_with_the_timeout_that_says_why():
    with BatchStream(["tcp://127.0.0.1:1"], batch_size=BATCH, recv_timeout=1) as stream:
        with pytest.raises(InputTimeoutError, match="nothing arrived: check the producers run"):
            next(stream)
    with pytest.raises(InputTimeoutError, match="waited for a first batch to learn it from"):
        BatchStream(["tcp://127.0.0.1:1"], recv_timeout=1)


def test_next_after_close_raises_closed(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        stream = BatchStream([producer.endpoint], recv_timeout=30)
        next(stream)
        stream.close()
        with pytest.raises(InputClosedError):
            for _ in range(100):  # what was queued may still come out first
                next(stream)


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_exact_mode_gives_every_record_once_and_resumes_from_saved_state(tmp_path, receive):
    # Both exact links: direct DEALERs read into memory the queue owns; libzmq DEALERs hand over read-only frames.
    records = 44  # not a multiple of the batch: the last batch is padded and cut
    data = tmp_path / "ds"
    build_synthetic(data, records, seed=1, num_classes=4, progress=False)
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--epochs", "1", "--seed", "5"]
    seen: Counter = Counter()
    with ProducerProcess(data, extra_args=args) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, receive=receive) as first:
            for _, batch in zip(range(2), first):
                seen.update(batch["index"].tolist())
            state = first.save_state()
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, resume_state=state,
                         receive=receive) as second:
            for batch in second:
                assert batch["mask"].all() and len(batch["index"]) <= BATCH
                seen.update(batch["index"].tolist())
            stats = second.stats
    assert sorted(seen) == list(range(records)) and set(seen.values()) == {1}
    # The control plane is counted: a hello, then credit for the batches queued in steps of half the window
    # (2 of rcvhwm 4: a message per two batches, the consumed records riding on it); the producer's status.
    assert stats.control_sent >= 1 + stats.batches // 2 and stats.control_bytes_sent > stats.control_sent
    assert stats.control_received >= 1 and stats.control_bytes_received > 0


def test_a_trainer_that_stops_reports_its_last_steps_so_no_other_trainer_gets_them_again(tmp_path):
    # Consumed records ride on credit and may wait up to REPORT_WAIT_S; a trainer that stops must send them
    # anyway, or the producer serves them again (to B here) once it takes the silent trainer A for dead.
    records = 48
    data = tmp_path / "ds"
    build_synthetic(data, records, seed=1, num_classes=4, progress=False)
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--epochs", "1", "--seed", "5",
            "--trainer-timeout", "2"]
    seen_a: Counter = Counter()
    seen_b: Counter = Counter()
    with ProducerProcess(data, extra_args=args) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, trainer_id="a") as a:
            for _, batch in zip(range(2), a):
                seen_a.update(batch["index"].tolist())
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, trainer_id="b") as b:
            for batch in b:  # the rest of the epoch, A's unconsumed batches included once it is dropped
                seen_b.update(batch["index"].tolist())
    assert len(seen_a) == 2 * BATCH
    assert not set(seen_a) & set(seen_b), "records A consumed were served again"
    assert sorted(seen_a + seen_b) == list(range(records)) and set((seen_a + seen_b).values()) == {1}


def test_importing_batch_stream_never_imports_tensorflow():
    code = textwrap.dedent("""
        import sys
        from stoker.consumer import BatchStream
        from stoker.consumer.numpy.batch_stream import BatchStream as B
        assert BatchStream is B
        assert "tensorflow" not in sys.modules, "BatchStream pulled in TensorFlow"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_long_exact_run_keeps_only_the_open_epochs_in_its_state(tmp_path):
    """Epochs the producer completed are closed in the trainer's state too, not kept as one bitmap each
    (a state holds at most 64 open epochs: a long run would otherwise stop loading after 64)."""
    data = tmp_path / "ds"
    build_synthetic(data, 16, seed=1, num_classes=4, progress=False)
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--epochs", "6", "--seed", "5"]
    with ProducerProcess(data, extra_args=args) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60) as stream:
            for batch in stream:
                pass
            state = parse_state(stream.save_state()).state
    (progress,) = state.streams.values()
    assert progress.completed == 6 and not progress.open


def test_an_exact_consumer_that_stops_taking_batches_keeps_its_connection(tmp_path):
    """A full queue stops the receive side reading. With ZMTP heartbeats that killed a healthy connection after
    their 5 s timeout (this test failed so), and the reconnect could abort the whole process inside libzmq
    (issue #3937, seen twice in CI); a pause of any length must leave the connection as it was."""
    import time

    data = tmp_path / "ds"
    build_synthetic(data, 64, seed=1, num_classes=4, progress=False)
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "128", "--seed", "5", "--exact"]
    with ProducerProcess(data, extra_args=args) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, queue_capacity=1) as stream:
            next(stream)
            time.sleep(8)  # the step is slow: nothing is taken, the producer's batches back up
            links = stream._core.receiver.control_plane.live_links()
            assert [link.handshakes for link in links] == [1], "the connection was dropped while the consumer paused"
            for _ in range(3):
                next(stream)
