"""benchmarks/exact_real_run.py on a small scale (issue 41): real producers in epoch order 2, one SIGKILLed and
restarted, a trainer SIGKILLed after a checkpoint, its lone state merged and resumed on 2 trainer processes. Keeps
the benchmark from rotting, and holds what it claims: each record once counting from the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_a_small_real_run_through_kills_and_a_resume_on_two_trainers_serves_each_record_once(tmp_path):
    out = tmp_path / "exact_real_run.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "exact_real_run.py"), "--records", "20000",
                           "--batch", "128", "--checkpoint-every", "10", "--data", str(tmp_path / "ds"),
                           "--out", str(out)], capture_output=True, text=True, timeout=200, cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["twice"] == 0 and result["never"] == 0 and result["rows_not_epoch_0"] == 0
    a, resumed = result["trainer_a"], result["resumed"]
    # The kills land at a step: A was killed past its checkpoint, and what it consumed after it came again.
    assert a["rows"] >= 10000 > a["checkpointed_rows"] > 0
    assert result["served_again_of_after_checkpoint"] == a["after_checkpoint_rows"] > 0
    assert all(rows > 0 for rows in resumed["rows_per_rank"])  # both ranks of 2 took part
    assert a["checkpointed_rows"] + resumed["rows"] == 20000
    # ranges of positions: order 1's bitmaps would take about 2.8 KB here (1.13 bits per record)
    assert result["checkpoint_bytes"] < 1024
