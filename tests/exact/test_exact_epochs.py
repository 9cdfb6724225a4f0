"""Exact epochs through failures and restarts, with real producer and trainer processes and real sockets.

Every test runs finite producers (``--epochs N``): the run ends when every record has been
consumed, so "each record exactly once" is checked on what the steps actually received,
with no timing involved.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import tensorflow as tf

from stoker.consumer import InputFinished, ZMQInput
from stoker.producer.process import ProducerProcess
from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import assert_exactly_once

pytestmark = pytest.mark.timeout(240)

RECORDS = 50  # not a multiple of the batch size: the last batch of each shard is partial
BATCH = 4


@pytest.fixture(scope="module")
def small_lmdb(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("exact") / "ds"
    build_synthetic(path, RECORDS, seed=2, num_classes=4, progress=False)
    return path


def _args(mode: str = "eval", shard: str = "0/1", epochs: int = 1, workers: int = 1, timeout: float = 10.0,
          min_trainers: int = 1):
    return ["--workers", str(workers), "--batch-size", str(BATCH), "--image-size", "16", "--mode", mode,
            "--seed", "3", "--shard", shard, "--epochs", str(epochs), "--trainer-timeout", str(timeout),
            "--min-trainers", str(min_trainers)]


def _consume(inp: ZMQInput, steps: int | None = None) -> list[tuple[int, int]]:
    """(epoch, index) of every row ``get()`` gave, for ``steps`` steps or until the run ends."""
    got = []
    for _ in range(steps if steps is not None else 10**6):
        try:
            batch = inp.get()
        except InputFinished:
            break
        assert batch["index"].shape[0] > 0, "get() returned a batch without rows"
        got += list(zip(batch["epoch"].numpy().tolist(), batch["index"].numpy().tolist()))
    return got


def test_evaluation_sees_every_validation_record_exactly_once_across_two_producers(small_lmdb):
    with ProducerProcess(small_lmdb, extra_args=_args(shard="0/2")) as a, \
            ProducerProcess(small_lmdb, extra_args=_args(shard="1/2")) as b:
        with ZMQInput([a.endpoint, b.endpoint], exact=True, recv_timeout=30) as inp:
            indices = [int(i) for batch in inp.as_dataset(x="index", y=()) for i in batch.numpy()]
        assert sorted(indices) == list(range(RECORDS))
        # Their run is over once the trainer said it finished: each exits by itself (a SIGTERM from stop() could
        # land while one is already on its way out, which says nothing of the run).
        assert a.proc.wait(30) == 0 and b.proc.wait(30) == 0
    # and model.evaluate over a fresh run counts every record once, partial batches at their true size
    with ProducerProcess(small_lmdb, extra_args=_args(shard="0/2")) as a, \
            ProducerProcess(small_lmdb, extra_args=_args(shard="1/2")) as b:
        with ZMQInput([a.endpoint, b.endpoint], exact=True, recv_timeout=30) as inp:
            model = tf.keras.Sequential([tf.keras.Input((16, 16, 3), dtype="uint8"), tf.keras.layers.Flatten(),
                                         tf.keras.layers.Dense(4)])
            model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=[_RecordCount()])
            result = model.evaluate(inp.as_dataset(), verbose=0, return_dict=True)
    assert result["records"] == RECORDS


class _RecordCount(tf.keras.metrics.Metric):
    """How many samples evaluate saw."""

    def __init__(self) -> None:
        super().__init__(name="records")
        self.total = self.add_weight(name="total", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.cast(tf.shape(y_true)[0], tf.float32))

    def result(self):
        return self.total


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_producer_killed_mid_epoch_and_restarted_serves_each_record_once(small_lmdb, mode):
    producer = ProducerProcess(small_lmdb, extra_args=_args(mode, workers=2))
    try:
        # A small queue: when the producer dies most of the epoch is still to come, some of it in flight.
        with ZMQInput([producer.endpoint], exact=True, recv_timeout=60, queue_capacity=2) as inp:
            rows = _consume(inp, steps=3)
            producer.kill()  # mid-epoch: batches in its slots, its sockets, and in flight are lost
            producer = ProducerProcess(small_lmdb, bind=producer.endpoint,
                                       extra_args=[*_args(mode, workers=2), "--log-interval", "0.2"])
            # Let the new incarnation choose and send what to serve while this trainer still holds the
            # batches it received before the crash: it must know they are taken.
            deadline = time.monotonic() + 60
            while not re.search(r"images_per_s=[1-9]", producer.log_text()):
                assert time.monotonic() < deadline, "the restarted producer served nothing"
                time.sleep(0.05)
            rows += _consume(inp)
        assert_exactly_once(rows, set(range(RECORDS)))
        assert producer.proc.wait(30) == 0, "--epochs 1: the producer stops by itself once the epoch is consumed"
        counters = producer.counters()
        assert counters is not None, "the producer wrote no stop summary to its status file"
        assert counters[0] >= 5, "the restarted producer should have served most of the epoch"
    finally:
        producer.stop()


def test_two_producers_one_killed_twice_still_give_each_record_once(small_lmdb):
    steady = ProducerProcess(small_lmdb, extra_args=_args(shard="1/2"))
    flaky = ProducerProcess(small_lmdb, extra_args=_args(shard="0/2"))
    try:
        with ZMQInput([flaky.endpoint, steady.endpoint], exact=True, recv_timeout=60, queue_capacity=2) as inp:
            rows = _consume(inp, steps=2)
            for _ in range(2):
                flaky.kill()
                flaky = ProducerProcess(small_lmdb, bind=flaky.endpoint, extra_args=_args(shard="0/2"))
                rows += _consume(inp, steps=2)
            rows += _consume(inp)
        assert_exactly_once(rows, set(range(RECORDS)))
    finally:
        flaky.stop()
        steady.stop()


# A trainer process: consumes with get(), logs each step's records, checkpoints (model step + input
# state) at step `save_at`, and SIGKILLs itself right after logging step `die_at`.
TRAINER = textwrap.dedent('''
    import json, os, signal, sys
    import tensorflow as tf
    from stoker.consumer import InputFinished, ZMQInput
    addresses, log_path, ckpt_dir = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    save_at, die_at, trainer_id = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    step = tf.Variable(0, dtype=tf.int64)
    with ZMQInput(addresses, exact=True, recv_timeout=60, trainer_id=trainer_id) as inp, open(log_path, "a") as log:
        checkpoint = tf.train.Checkpoint(step=step, input=inp)
        latest = tf.train.latest_checkpoint(ckpt_dir)
        if latest:
            checkpoint.restore(latest)  # before the first get(): the producers serve from this state
        while True:
            try:
                batch = inp.get()
            except InputFinished:
                break
            step.assign_add(1)
            rows = list(zip(batch["epoch"].numpy().tolist(), batch["index"].numpy().tolist()))
            log.write(json.dumps({"step": int(step), "rows": rows}) + "\\n")
            log.flush()
            if int(step) == save_at:
                checkpoint.save(os.path.join(ckpt_dir, "ckpt"))
            if int(step) == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
    print("finished")
''')


def _trainer(addresses, log: Path, ckpt: Path, save_at: int = -1, die_at: int = -1, trainer_id: str = "t0"):
    return subprocess.Popen([sys.executable, "-c", TRAINER, ",".join(addresses), str(log), str(ckpt), str(save_at),
                             str(die_at), trainer_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2"})


def _logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


# Order 1 on fixed shards; order 2 (issue 41: the checkpoint holds ranges of epoch positions, input state version 2)
# on a pool, as order 2 serves only pools.
@pytest.mark.parametrize("shards, order", [(("0/2", "1/2"), "1"), (("auto", "auto"), "2")])
def test_a_trainer_killed_and_restarted_from_a_checkpoint_consumes_each_record_once(small_lmdb, tmp_path, shards,
                                                                                     order):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    args = [_args(shard=shard) + ["--epoch-order", order] for shard in shards]
    with ProducerProcess(small_lmdb, extra_args=args[0]) as a, ProducerProcess(small_lmdb, extra_args=args[1]) as b:
        first = _trainer([a.endpoint, b.endpoint], tmp_path / "run1.log", ckpt, save_at=3, die_at=7)
        assert first.wait(180) == -9, first.stderr.read()[-3000:]  # it killed itself after step 7
        second = _trainer([a.endpoint, b.endpoint], tmp_path / "run2.log", ckpt)
        out, err = second.communicate(timeout=180)
        producers = f"\nproducer a:\n{a.log_text()[-2000:]}\nproducer b:\n{b.log_text()[-2000:]}"
        assert second.returncode == 0 and "finished" in out, err[-3000:] + producers
    before = [r for entry in _logged(tmp_path / "run1.log") if entry["step"] <= 3 for r in entry["rows"]]
    after = [r for entry in _logged(tmp_path / "run2.log") for r in entry["rows"]]
    assert _logged(tmp_path / "run2.log")[0]["step"] == 4  # the model's step came back with the input state
    assert_exactly_once([tuple(r) for r in before + after], set(range(RECORDS)))


def test_two_trainers_one_killed_the_epoch_completes_on_the_survivor_with_nothing_lost(small_lmdb, tmp_path):
    # A dead trainer is noticed after 2 s. Both trainers must have joined before anything is served:
    # otherwise whichever imports TensorFlow first may take the whole epoch and the other never reaches
    # the step it dies at. Once both joined, batches alternate between them, so each gets >= 3 per shard.
    args = lambda shard: _args(shard=shard, timeout=2, min_trainers=2)  # noqa: E731
    with ProducerProcess(small_lmdb, extra_args=args("0/2")) as a, ProducerProcess(small_lmdb, extra_args=args("1/2")) as b:
        addresses = [a.endpoint, b.endpoint]
        doomed = _trainer(addresses, tmp_path / "doomed.log", tmp_path, die_at=3, trainer_id="doomed")
        survivor = _trainer(addresses, tmp_path / "survivor.log", tmp_path, trainer_id="survivor")
        assert doomed.wait(180) == -9, doomed.stderr.read()[-3000:]
        out, err = survivor.communicate(timeout=180)
        assert survivor.returncode == 0 and "finished" in out, err[-3000:]
    doomed_rows = Counter(r[1] for e in _logged(tmp_path / "doomed.log") for r in e["rows"])
    survivor_rows = Counter(r[1] for e in _logged(tmp_path / "survivor.log") for r in e["rows"])
    assert set(doomed_rows) | set(survivor_rows) == set(range(RECORDS)), "records were lost with the dead trainer"
    # Served twice can only be what the dead trainer consumed but had not reported when it was killed.
    # How much that is depends on when its receive loop last flushed (it may have been none of its
    # three steps), so this test holds the set, not a count; that reported records are never served
    # again is test_exact_server's test_a_dead_trainers_records_go_to_the_survivor_... .
    twice = {i for i in survivor_rows if i in doomed_rows}
    assert twice <= set(doomed_rows), twice
    assert set(survivor_rows.values()) == {1}


def test_the_input_state_round_trips_and_is_restored_only_before_receiving(small_lmdb):
    with ProducerProcess(small_lmdb, extra_args=_args(epochs=2)) as producer:
        with ZMQInput([producer.endpoint], exact=True, recv_timeout=30, trainer_id="rank3") as inp:
            rows = _consume(inp, steps=2)
            state = inp.save_state()
            with pytest.raises(RuntimeError, match="restore the input state before the first get"):
                inp.restore_state(state)
        assert len(state) < 600, len(state)  # a few hundred bytes for a 50-record shard mid-epoch
        resumed = ZMQInput([producer.endpoint], exact=True, recv_timeout=30, resume_state=state)
        try:
            assert resumed.trainer_id == "rank3"
            rest = _consume(resumed)
        finally:
            resumed.close()
    seen = Counter(rows + rest)
    assert {(0, i) for i in range(RECORDS)} <= set(seen) and {(1, i) for i in range(RECORDS)} <= set(seen)
    assert set(seen.values()) == {1}
    with pytest.raises(ValueError, match="resume_state and trainer_id belong to exact mode"):
        ZMQInput(["tcp://127.0.0.1:1"], resume_state=state, batch_size=2)
    with pytest.raises(ValueError, match="printable ASCII characters without spaces"):  # producers would refuse it
        ZMQInput(["tcp://127.0.0.1:1"], exact=True, trainer_id="rank 3", batch_size=2)


def test_a_tf_function_loop_ends_with_out_of_range_after_the_last_record(small_lmdb):
    with ProducerProcess(small_lmdb, extra_args=_args(workers=2)) as producer:
        with ZMQInput([producer.endpoint], exact=True, recv_timeout=30) as inp:
            @tf.function
            def step():
                batch = inp.get()
                return batch["epoch"], batch["index"], tf.shape(batch["images"])[0]

            rows, sizes = [], []
            with pytest.raises(tf.errors.OutOfRangeError):
                while True:
                    epochs, indices, size = step()
                    rows += list(zip(epochs.numpy().tolist(), indices.numpy().tolist()))
                    sizes.append(int(size))
    assert_exactly_once(rows, set(range(RECORDS)))
    assert sizes[-1] == RECORDS % BATCH or sizes.count(RECORDS % BATCH) == 1  # one true-size partial batch


def test_a_trainer_alone_in_a_synchronous_job_says_what_it_waits_for_then_trains_when_the_other_joins(
        small_lmdb, caplog):
    import logging
    import threading

    caplog.set_level(logging.WARNING, logger="stoker.consumer")
    with ProducerProcess(small_lmdb, extra_args=_args(min_trainers=2)) as producer:
        with ZMQInput([producer.endpoint], exact=True, recv_timeout=60, trainer_id="first") as first:
            got: dict[str, list] = {}
            thread = threading.Thread(target=lambda: got.setdefault("first", _consume(first)), daemon=True)
            thread.start()  # blocks in get(): the producer serves nothing to one trainer
            deadline = time.monotonic() + 60
            while "serves nothing until 1 more trainer(s) join" not in caplog.text:
                assert time.monotonic() < deadline and thread.is_alive(), "the waiting trainer said nothing"
                time.sleep(0.05)
            with ZMQInput([producer.endpoint], exact=True, recv_timeout=60, trainer_id="second") as second:
                got["second"] = _consume(second)
                thread.join(60)
        assert not thread.is_alive()
    assert_exactly_once(got["first"] + got["second"], set(range(RECORDS)))


def test_train_reports_whether_its_rate_includes_the_warm_up(small_lmdb):
    """An exact run over a 13-batch epoch: with 20 warm-up steps nothing comes after the warm-up, and the
    report says its rate is over the whole run; with 2 it is timed over the 11 steps after them."""
    from stoker.consumer.train.loop import TrainConfig, train

    for warmup, includes in ((20, True), (2, False)):
        producer = ProducerProcess(small_lmdb, extra_args=_args("train"))
        try:
            report = train(TrainConfig(addresses=[producer.endpoint], steps=1000, batch_size=BATCH, image_size=16,
                                       num_classes=4, warmup_steps=warmup, progress=False, exact=True,
                                       recv_timeout=60))
        finally:
            producer.stop()
        assert report.steps == -(-RECORDS // BATCH)  # the epoch ended the run
        assert report.includes_warmup is includes
        assert ("tracing and pre-fill included" in report.summary()) is includes
        assert ("images/s (whole run, warm-up included)" in report.facts()) is includes
        assert report.images_per_s > 0


def test_a_trainer_in_an_ordinary_job_is_never_told_it_waits_for_more_trainers(small_lmdb, caplog):
    # The producer's answer to a describe sent before the trainer joined says "waiting for 1 more"
    # (that trainer itself); read after the trainer's hello, it must not become a warning. The pause
    # is where a user builds the model between creating the input and the first step.
    import logging

    caplog.set_level(logging.WARNING, logger="stoker.consumer")
    with ProducerProcess(small_lmdb, extra_args=_args()) as producer:
        with ZMQInput([producer.endpoint], exact=True, recv_timeout=60, batch_size=BATCH,
                      image_shape=(16, 16, 3)) as inp:
            time.sleep(1.0)
            rows = _consume(inp)
    assert_exactly_once(rows, set(range(RECORDS)))
    assert "more trainer" not in caplog.text


def test_an_elastic_pools_completed_epochs_are_logged_in_summary_not_a_line_each(tmp_path, caplog, monkeypatch):
    """A small dataset completes an epoch a second: the trainer says the first at INFO, then one line per interval
    for those since (here one interval spans the run, whatever the machine's speed) and the run's last at once;
    each epoch still has its DEBUG line."""
    import logging

    from stoker.consumer.numpy.batch_stream import BatchStream
    from stoker.consumer.exact.pool import split_epoch

    monkeypatch.setattr(split_epoch, "SUMMARY_EVERY_S", 1e9)
    epochs, records = 12, 16
    build_synthetic(tmp_path / "ds", records, seed=2, num_classes=4, progress=False)
    caplog.set_level(logging.DEBUG, logger="stoker.consumer")
    args = ["--shard", "auto", "--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--seed", "3",
            "--epochs", str(epochs)]
    with ProducerProcess(tmp_path / "ds", extra_args=args) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60) as stream:
            rows = Counter((e, i) for batch in stream for e, i in zip(batch["epoch"].tolist(), batch["index"].tolist()))
    assert set(rows) == {(e, i) for e in range(epochs) for i in range(records)} and set(rows.values()) == {1}
    said = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records
            if "complete: every record" in r.getMessage()]
    assert [what for level, what in said if level == logging.DEBUG] == [f"epoch {e} complete" for e in range(epochs)]
    assert [what for level, what in said if level == logging.INFO] == ["epoch 0 complete",
                                                                       f"epochs 1-{epochs - 1} complete"]


def test_the_epoch_log_says_the_first_epoch_then_at_most_a_line_per_interval_and_the_last_at_once(caplog):
    import logging

    from stoker.consumer.exact.pool.split_epoch import EpochLog

    caplog.set_level(logging.INFO, logger="stoker.consumer")
    epoch_log = EpochLog(every=60.0)
    for epoch, now in enumerate([0.0, 1.0, 2.0, 61.0, 62.0]):
        epoch_log.completed(epoch, now=now)
    epoch_log.completed(5, last=True, now=63.0)  # a finite run's last epoch: said at once
    epoch_log.flush()  # nothing pending: nothing said
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["epoch 0 complete", "epochs 1-3 complete",
                                                                      "epochs 4-5 complete"]
    epoch_log.completed(6, now=64.0)
    epoch_log.flush(now=65.0)  # the input closes: what is pending is said
    assert caplog.records[-1].getMessage().startswith("epoch 6 complete")
