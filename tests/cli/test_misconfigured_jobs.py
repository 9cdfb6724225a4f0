"""Jobs put together wrongly are named at once: exact vs plain modes, and producers whose shards overlap.

Real producer processes, real sockets, real TensorFlow. Each misconfiguration is one that waiting
cannot fix, so the trainer must say so well before its ``recv_timeout`` (set far beyond the test's
own timeout, so a fall-back to the timeout fails the test instead of passing slowly).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time

import pytest

from stoker.consumer import InputError, InputMismatchError, InputTimeoutError, ZMQInput
from stoker.producer.process import ProducerProcess
from conftest import SYNTH_CLASSES, one_worker_producer, unused_port

pytestmark = pytest.mark.timeout(150)

BATCH, SIZE = 8, 32
NEVER = 3600.0  # recv_timeout: the test's own timeout ends first if the trainer waits for it


_producer = functools.partial(one_worker_producer, batch=BATCH, size=SIZE)


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_a_plain_trainer_facing_exact_producers_fails_at_once_saying_so(synth_lmdb, receive):
    with _producer(synth_lmdb, "--exact") as producer:
        with ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=NEVER,
                      receive=receive) as inp:
            with pytest.raises(InputError) as failure:
                inp.get()
            stats = inp.stats
    assert not isinstance(failure.value, InputTimeoutError)
    assert "refused the connection 3 times in a row" in str(failure.value)
    assert "exact mode" in str(failure.value) and producer.endpoint in str(failure.value)
    assert stats.batches == 0 and stats.handshake_failures >= 1


def test_an_exact_trainer_facing_plain_producers_fails_at_once_saying_so(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        with pytest.raises(InputError) as failure:  # waiting for the producers to describe their batches
            ZMQInput([producer.endpoint], exact=True, recv_timeout=NEVER)
    assert not isinstance(failure.value, InputTimeoutError)
    assert "refused the connection 3 times in a row" in str(failure.value) and "exact mode" in str(failure.value)


def _until_both_sent(inp, producers: int = 2, steps: int = 200) -> None:
    """Take batches until every producer's batches arrived (bounded by steps, not by time)."""
    for _ in range(steps):
        inp.get()
        if len(inp.stats.per_producer) >= producers:
            return
    raise AssertionError(f"only {inp.stats.per_producer} sent within {steps} steps")


def test_producers_whose_shards_disagree_are_named_once_and_counted(synth_lmdb, caplog):
    with _producer(synth_lmdb, "--seed", "1") as whole, _producer(synth_lmdb, "--shard", "1/2", "--seed", "1") as half, \
            ZMQInput([whole.endpoint, half.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3),
                     recv_timeout=60) as inp:
        _until_both_sent(inp)
        for _ in range(10):  # more batches from both: still one conflict, one warning
            inp.get()
        stats = inp.stats
    assert stats.shard_conflicts == 1
    assert "0/1" in stats.last_shard_conflict and "1/2" in stats.last_shard_conflict
    assert "shard counts disagree" in stats.last_shard_conflict and "--shard 0/N" in stats.last_shard_conflict
    assert sorted(stream.split(":")[0] for stream in stats.producer_streams.values()) == ["0/1", "1/2"]
    assert sum("shard counts disagree" in r.getMessage() for r in caplog.records) == 1


def test_two_producers_serving_the_same_shard_with_the_same_seed_are_named(synth_lmdb):
    with _producer(synth_lmdb, "--shard", "0/2", "--seed", "3") as a, \
            _producer(synth_lmdb, "--shard", "0/2", "--seed", "3") as b, \
            ZMQInput([a.endpoint, b.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=60) as inp:
        _until_both_sent(inp)
        stats = inp.stats
    assert stats.shard_conflicts == 1 and "both serve shard 0/2 with seed 3" in stats.last_shard_conflict


def test_distinct_shards_and_distinct_seeds_are_not_a_conflict(synth_lmdb):
    with _producer(synth_lmdb, "--shard", "0/2", "--seed", "1") as a, \
            _producer(synth_lmdb, "--shard", "1/2", "--seed", "1") as b, \
            ZMQInput([a.endpoint, b.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=60) as inp:
        _until_both_sent(inp)
        stats = inp.stats
    assert stats.shard_conflicts == 0 and len(stats.producer_streams) == 2


def test_exact_mode_refuses_producers_whose_shards_overlap(synth_lmdb):
    with _producer(synth_lmdb, "--exact", "--seed", "1") as whole, \
            _producer(synth_lmdb, "--exact", "--shard", "1/2", "--seed", "1") as half, \
            ZMQInput([whole.endpoint, half.endpoint], exact=True, recv_timeout=60) as inp:
        with pytest.raises(InputError, match="exact mode cannot hold every record once per epoch.*shard counts "
                                             "disagree"):
            for _ in range(400):  # until both producers' batches arrived; bounded by steps
                inp.get()


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_producers_at_another_batch_size_fail_at_once_naming_the_flags(synth_lmdb, receive):
    with _producer(synth_lmdb, "--shard", "0/2") as a, _producer(synth_lmdb, "--shard", "1/2") as b, \
            ZMQInput([a.endpoint, b.endpoint], batch_size=2 * BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=NEVER,
                     receive=receive) as inp:
        with pytest.raises(InputMismatchError) as failure:
            inp.get()
        stats = inp.stats
    message = str(failure.value)
    assert f"every producer at {a.endpoint}, {b.endpoint}" in message and "(2 producer(s), 3 or more" in message
    assert f"start the producers with --batch-size {2 * BATCH}" in message
    assert f"(stoker train: --batch-size {BATCH})" in message
    assert stats.batches == 0 and stats.mismatched_batches >= 2


def test_one_producer_at_another_image_size_does_not_stop_a_pool_that_delivers(synth_lmdb):
    with _producer(synth_lmdb, "--shard", "0/2") as good, \
            ProducerProcess(synth_lmdb, extra_args=["--workers", "1", "--batch-size", str(BATCH), "--image-size",
                                                    str(SIZE // 2), "--shard", "1/2"]) as bad, \
            ZMQInput([good.endpoint, bad.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3),
                     recv_timeout=NEVER) as inp:
        for _ in range(400):  # bounded by steps: until the wrong producer's batches were refused
            inp.get()
            if inp.stats.mismatched_batches:
                break
        for _ in range(20):  # the good producer's batches still arrive
            inp.get()
        stats = inp.stats
    assert stats.mismatched_batches >= 1 and stats.batches >= 20
    assert f"(stoker train: --image-size {SIZE // 2})" in stats.last_error


def _wait_for_log(caplog, text: str, bound_s: float = 100.0) -> str:
    deadline = time.monotonic() + bound_s  # a bound against hanging, far beyond when the warning is due
    while time.monotonic() < deadline:
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line with {text!r}")


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_a_trainer_warns_early_naming_an_address_nothing_listens_on(caplog, receive):
    address = f"tcp://127.0.0.1:{unused_port()}"
    with ZMQInput([address], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=NEVER, receive=receive):
        line = _wait_for_log(caplog, "cannot reach producers")
    assert address in line and "stoker produce" in line
    assert receive == "libzmq" or "refused" in line.lower()


def test_a_trainer_warns_early_naming_a_name_that_does_not_resolve(caplog):
    with ZMQInput(["tcp://no-such-producer.invalid:5555"], batch_size=BATCH, image_shape=(SIZE, SIZE, 3),
                  recv_timeout=NEVER):
        line = _wait_for_log(caplog, "cannot reach producers")
    assert "no-such-producer.invalid" in line and "does not resolve" in line


def test_stoker_train_against_producers_at_another_batch_size_exits_at_once_naming_its_flag(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--connect", producer.endpoint,
                              "--batch-size", str(2 * BATCH), "--image-size", str(SIZE), "--steps", "5",
                              "--model", "small-cnn", "--recv-timeout", str(NEVER), "--no-progress"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"(stoker train: --batch-size {BATCH})" in out.stderr and "can never take" in out.stderr


def _train(endpoint: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--connect", endpoint,
                           "--batch-size", str(BATCH), "--image-size", str(SIZE), "--steps", "3", "--model",
                           "small-cnn", "--recv-timeout", "60", "--no-progress", *extra],
                          capture_output=True, text=True, timeout=120)


def test_stoker_train_refuses_fewer_classes_than_the_dataset_names_saying_which_to_pass(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        refused = _train(producer.endpoint, "--classes", str(SYNTH_CLASSES - 1))
        taken = _train(producer.endpoint)  # no --classes: the dataset's
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"pass --classes {SYNTH_CLASSES}" in refused.stderr and "Traceback" not in refused.stderr
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert f"with {SYNTH_CLASSES} classes (the producers' dataset's" in taken.stderr


def test_stoker_train_names_the_flag_when_a_pipeline_makes_labels_beyond_the_model(synth_lmdb):
    with ProducerProcess(synth_lmdb, extra_args=[
            "--workers", "1", "--batch-size", str(BATCH), "--pipeline", "tests/pipelines/shifted_labels.py:make_pipeline",
            "--pipeline-arg", f"size={SIZE}", "--pipeline-arg", f"shift={SYNTH_CLASSES}"]) as producer:
        out = _train(producer.endpoint)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"at or above the model's {SYNTH_CLASSES} classes: pass --classes" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("command", [["bench", "link"], ["doctor", "--model", "small-cnn", "--steps", "1"]])
def test_doctor_and_bench_link_against_exact_producers_exit_at_once_saying_why(synth_lmdb, command):
    # Issue 39.10: both used to wait 30 s and end in a traceback ("TimeoutError: no valid batch").
    with _producer(synth_lmdb, "--exact") as producer:
        out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command, "--connect", producer.endpoint,
                              "--seconds", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "refused the connection 3 times in a row" in out.stderr
    assert f"{producer.endpoint} is a ROUTER socket: most likely the producer runs in exact mode" in out.stderr
    assert f"stoker {command[0]}" in out.stderr and "does not join an exact-mode job" in out.stderr
