"""A trainer that leaves says goodbye: a real exact producer logs it at INFO and forgets the trainer at once.

A trainer's input that closes (``close()``, the end of its run, leaving the ``with`` block) sends each
producer that announces it takes one (``goodbye`` in its status) a ``goodbye``; the producer serves
what that trainer held to the others at once, answers, and counts it in its stop summary. (Before the
trainer waited for that answer, the first test failed about 1 run in 5: closing with batches unread
reset the connection, and the producer, writing into the reset, lost the goodbye.) A trainer killed
outright says nothing and keeps today's handling: a WARNING once the producer finds it unreachable or
silent. The producers log JSON lines here, so each assertion reads a level and a message, and every
wait is on a line or an event, bounded.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.producer.process import ProducerProcess

pytestmark = pytest.mark.timeout(180)

BATCH = 4
RECORDS = 96  # conftest's synth_lmdb
WAIT_S = 60.0


def _args(trainer_timeout: float) -> list[str]:
    return ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--seed", "5", "--epochs", "1",
            "--trainer-timeout", str(trainer_timeout), "--log-format", "json"]


def _log(producer: ProducerProcess) -> list[dict]:
    """The producer's log lines so far (JSON), a line still being written left out."""
    lines = []
    for line in producer.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "msg" in entry:
            lines.append(entry)
    return lines


def _about(producer: ProducerProcess, trainer: str) -> list[dict]:
    return [e for e in _log(producer) if f"trainer {trainer} " in e["msg"]]


def _wait_for_line(producer: ProducerProcess, trainer: str, words: tuple[str, ...]) -> dict:
    """The first log line about ``trainer`` holding any of ``words``, waited for up to WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [e for e in _about(producer, trainer) if any(w in e["msg"] for w in words)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no line about {trainer} with {words}:\n{producer.log_text()[-3000:]}"
        assert producer.proc.poll() is None, producer.log_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_a_trainer_that_closes_its_input_says_goodbye_and_the_producer_logs_it_at_info(synth_lmdb, receive):
    # --trainer-timeout 600: nothing here may depend on the producer taking a silent trainer for dead.
    seen: Counter = Counter()
    with ProducerProcess(synth_lmdb, extra_args=_args(trainer_timeout=600)) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, trainer_id="leaver",
                         receive=receive) as leaver:
            for _, batch in zip(range(2), leaver):
                seen.update(batch["index"].tolist())
        line = _wait_for_line(producer, "leaver", ("said goodbye", "unreachable", "taken for dead"))
        assert line["level"] == "INFO" and "said goodbye" in line["msg"], line
        # What it held (batches sent ahead of its steps) goes to the next trainer: the epoch completes.
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60, trainer_id="stayer",
                         receive=receive) as stayer:
            for batch in stayer:
                seen.update(batch["index"].tolist())
    assert sorted(seen) == list(range(RECORDS)) and set(seen.values()) == {1}
    about = _about(producer, "leaver")
    assert [e for e in about if e["level"] != "INFO"] == [], about
    assert not [e for e in about if "unreachable" in e["msg"] or "taken for dead" in e["msg"]], about
    stopped = producer.status.event("stopped")
    assert stopped is not None and stopped["trainers_lost"] == 0, stopped
    assert stopped["goodbyes"] >= 1, stopped  # the stayer's too, if the finished producer was still there


_TRAINER = textwrap.dedent("""
    import sys
    from stoker.consumer.numpy.batch_stream import BatchStream

    stream = BatchStream([sys.argv[1]], exact=True, recv_timeout=60, trainer_id="doomed")
    next(stream)
    print("took a batch", flush=True)
    sys.stdin.read()  # until it is killed
""")


def test_a_trainer_killed_without_goodbye_is_still_taken_for_gone_with_a_warning(synth_lmdb):
    with ProducerProcess(synth_lmdb, extra_args=_args(trainer_timeout=2)) as producer:
        trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, producer.endpoint], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([trainer.stdout], [], [], WAIT_S)
            assert ready and trainer.stdout.readline().strip() == "took a batch", trainer.stderr.read()[-3000:]
        finally:
            trainer.kill()
            trainer.wait(10)
            trainer.stdin.close()
        line = _wait_for_line(producer, "doomed", ("said goodbye", "unreachable", "taken for dead"))
        assert line["level"] == "WARNING" and "said goodbye" not in line["msg"], line
    assert not [e for e in _about(producer, "doomed") if "said goodbye" in e["msg"]]
    stopped = producer.status.event("stopped")
    assert stopped is not None and stopped["goodbyes"] == 0 and stopped["trainers_lost"] >= 1, stopped
