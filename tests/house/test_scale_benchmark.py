"""benchmarks/scale.py on a small scale: real producers, real trainer processes, exact mode's control
plane counted, the input state written and read back. Keeps the benchmark from rotting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_a_small_scale_run_reports_every_part(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--producers", "3", "--fan-in", "1,3",
                           "--trainers", "1,2", "--warmup", "3", "--batches", "40", "--state-records", "100000",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["producers"] for r in result["fan_in"]] == [1, 3]
    for row in result["fan_in"]:
        assert row["producers_seen"] == row["producers"] and row["setup_s"] is not None
        assert row["cpu_ms_per_batch"] > 0 and row["threads"] >= 3 + row["producers"]  # a receive thread each
    assert [len(t["per_trainer"]) for t in result["trainers"]] == [1, 2]
    for row in result["exact"]:
        # Credit goes back in steps of 2 batches (half the window of 4) per producer, so 40 batches queued send
        # at least (40 - 3 producers) / 2 messages; reports ride on them, heartbeats come on top.
        assert row["control_sent_per_batch"] >= 0.4 and row["control_bytes_sent_per_batch"] > 0
    state = result["state"][0]
    assert state["records"] == 100_000 and state["read_back_equal"] and state["state_bytes"] > 100_000 / 8
