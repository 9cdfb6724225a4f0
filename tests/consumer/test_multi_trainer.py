"""Several trainer processes sharing one producer pool: PUSH hands each batch to exactly one of them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from stoker.producer.process import ProducerProcess

from conftest import EVAL_SIZE, SYNTH_COUNT

pytestmark = pytest.mark.timeout(240)

# A trainer that logs what each step consumed (record index and epoch, from get() by name) until
# told to stop; `delay` seconds per step makes a slow one, `steps` a bounded one.
TRAINER = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    import tensorflow as tf
    from stoker.consumer import ZMQInput
    addresses, log, stop, delay, steps = sys.argv[1].split(","), Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    with ZMQInput(addresses, batch_size=8, image_shape=(32, 32, 3), recv_timeout=60, queue_capacity=4) as inp, \\
            open(log, "w") as out:
        @tf.function
        def step():
            batch = inp.get()
            return batch["index"], batch["epoch"]
        done = 0
        while not stop.exists() and done != steps:
            index, epoch = step()
            out.write(" ".join(f"{i}:{e}" for i, e in zip(index.numpy(), epoch.numpy())) + "\\n")
            out.flush()
            done += 1
            time.sleep(delay)
        out.write("done\\n")
''')


def _trainer(addresses, log: Path, stop: Path, delay: float = 0.0, steps: int = -1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, ",".join(addresses), str(log), str(stop), str(delay),
                             str(steps)], env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _consumed(log: Path) -> list[tuple[int, int]]:
    pairs = []
    for line in log.read_text().splitlines() if log.exists() else []:
        if line and line != "done":
            pairs += [tuple(int(v) for v in item.split(":")) for item in line.split()]
    return pairs


def _stop(procs, stop: Path) -> None:
    """Ask every trainer to stop; kill any still busy after 30 s (a stalled one sleeps)."""
    stop.touch()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def eval_producers(synth_lmdb):
    args = ["--workers", "1", "--batch-size", "8", "--image-size", str(EVAL_SIZE), "--mode", "eval", "--seed", "3"]
    with ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "0/2"]) as a, \
            ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "1/2"]) as b:
        yield [a.endpoint, b.endpoint]


def test_three_trainers_together_see_every_record_exactly_once_per_epoch(eval_producers, tmp_path):
    logs, stop = [tmp_path / f"trainer{i}.log" for i in range(3)], tmp_path / "stop"
    trainers = [_trainer(eval_producers, log, stop) for log in logs]
    try:
        deadline = time.monotonic() + 180
        # Until the trainers together have consumed all of epoch 0, and each of them something: they keep
        # consuming, and PUSH round-robins over every connected trainer, so both happen, however late one starts.
        while True:
            consumed = [_consumed(log) for log in logs]
            per_trainer = [[i for i, e in pairs if e == 0] for pairs in consumed]
            union = Counter(i for records in per_trainer for i in records)
            if set(union) == set(range(SYNTH_COUNT)) and all(consumed):
                break
            assert all(t.poll() is None for t in trainers), [t.stderr.read()[-2000:] for t in trainers if t.poll()]
            assert time.monotonic() < deadline, f"epoch 0 incomplete: {len(union)} of {SYNTH_COUNT} records"
            time.sleep(0.2)
    finally:
        _stop(trainers, stop)
    assert set(union.values()) == {1}, "a record reached two trainers (or one twice) in one epoch"


def test_a_stalled_trainer_gets_fewer_batches_and_never_holds_back_the_others(eval_producers, tmp_path):
    stop = tmp_path / "stop"
    slow = _trainer(eval_producers, tmp_path / "slow.log", stop, delay=3600, steps=1)  # takes one step, then sits
    fast = _trainer(eval_producers, tmp_path / "fast.log", stop, steps=150)
    try:
        assert fast.wait(180) == 0, fast.stderr.read()[-3000:]  # 150 steps while the other one consumes nothing
        assert slow.poll() is None
    finally:
        _stop([slow, fast], stop)
    assert len(_consumed(tmp_path / "fast.log")) == 150 * 8
    assert len(_consumed(tmp_path / "slow.log")) == 8
