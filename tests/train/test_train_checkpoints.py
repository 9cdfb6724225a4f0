"""``stoker train`` as a user runs it, against real producers (issue 39 items 7, 13, 14).

- Exact mode with ``--checkpoint-dir``: a trainer stopped by SIGTERM mid-epoch saves after a whole step and
  ``--resume`` goes on from there: each record of each epoch trained exactly once across the restart, counted
  from what each run's steps logged (``--log-consumed``). A resume against producers of another stream is refused.
- Producers of batch 8 and 32x32 images train without ``--batch-size``/``--image-size`` (learned from them).
- Ctrl-C still prints the summary and writes the ``--report``.

Every wait is on a condition (a file, a line) with a generous bound, never on a time.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import one_worker_producer

pytestmark = pytest.mark.timeout(300)

RECORDS, BATCH, SIZE = 48, 8, 32  # 6 steps an epoch; neither the batch nor the size is stoker train's old default


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train-ckpt") / "ds"
    build_synthetic(path, RECORDS, seed=1, num_classes=6, progress=False)
    return path


_producer = functools.partial(one_worker_producer, batch=BATCH, size=SIZE, flags=("--trainer-timeout", "3"))


def _train(endpoint: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stoker.cli.main", "train", "--connect", endpoint, "--no-progress",
                             "--recv-timeout", "60", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait(condition: Callable[[], bool], proc: subprocess.Popen, what: str, bound_s: float = 150.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"stoker train exited ({proc.returncode}) before {what}: {(out + err)[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {bound_s} s"
        time.sleep(0.1)


def _steps(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _rows(log: Path) -> list[tuple[int, int]]:
    return [(e, i) for step in _steps(log) for e, i in zip(step["epoch"], step["index"])]


def test_sigterm_saves_a_checkpoint_and_resume_trains_each_record_once_learning_the_batches(dataset, tmp_path):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    with _producer(dataset, "--exact", "--seed", "1") as producer:  # endless: only the signal ends the first run
        run = _train(producer.endpoint, "--exact", "--steps", "100000", "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", "4", "--log-consumed", str(first), "--report", str(tmp_path / "r.html"))
        # mid-epoch, after a checkpoint: one at step 4 (or 8) and steps after it (step 10: in the second epoch; the log is
        # flushed every 10 steps)
        _wait(lambda: (ckpt / "checkpoint").exists() and len(_steps(first)) >= 10, run, "checkpoint and 10 steps")
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=120)
        assert run.returncode == 130, err[-3000:]
        assert "trained" in out and "bottleneck:" in out and (tmp_path / "r.html").exists()  # item 13, by SIGTERM
        stopped_at = _steps(first)[-1]["step"]
        assert f"checkpoint of step {stopped_at}:" in err  # saved after the last whole step, not only every 4
        resumed = _train(producer.endpoint, "--exact", "--steps", str(stopped_at + 20), "--checkpoint-dir",
                         str(ckpt), "--resume", "--log-consumed", str(second))
        out, err = resumed.communicate(timeout=200)
        assert resumed.returncode == 0, err[-3000:]
    assert f"resumed at step {stopped_at}" in err and f"trained 20 steps" in out
    assert _steps(second)[0]["step"] == stopped_at + 1
    rows = _rows(first) + _rows(second)
    twice = [r for r, n in Counter(rows).items() if n > 1]
    assert not twice, f"trained twice across the restart: {sorted(twice)[:20]}"
    epochs = sorted({e for e, _ in rows})
    assert len(epochs) >= 4
    for epoch in epochs[:-2]:  # the last two may be open (one epoch ahead)
        assert {i for e, i in rows if e == epoch} == set(range(RECORDS)), f"epoch {epoch} incomplete"
    with _producer(dataset, "--exact", "--seed", "2") as other:  # another stream: the resume is refused
        refused = _train(other.endpoint, "--exact", "--steps", "100000", "--checkpoint-dir", str(ckpt), "--resume")
        out, err = refused.communicate(timeout=200)
    assert refused.returncode == 2, err[-3000:]
    assert "the producers serve 0/1:48:2" in err and "trained on 0/1:48:1" in err and "--seed" in err


def test_ctrl_c_prints_the_summary_and_writes_the_report(dataset, tmp_path):
    report, log = tmp_path / "run.html", tmp_path / "steps.jsonl"
    with _producer(dataset, "--seed", "1") as producer:
        run = _train(producer.endpoint, "--steps", "100000", "--report", str(report), "--log-consumed", str(log))
        _wait(lambda: len(_steps(log)) >= 10, run, "10 steps")
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
    assert run.returncode == 130 and "stoker train: interrupted" in err, err[-3000:]
    assert "trained" in out and "bottleneck:" in out and f"report (HTML): {report}" in out
    assert report.exists() and report.stat().st_size > 0
