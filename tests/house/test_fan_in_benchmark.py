"""benchmarks/fan_in.py on a small scale: a fleet of 4 endpoints, a real trainer per trial, two interleaved rounds,
in plain and exact mode.
Keeps the benchmark from rotting; no figure is held to a threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_a_small_run_reads_every_endpoint_and_reports_each_fan_in(tmp_path):
    out = tmp_path / "fan_in.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fan_in.py"), "--fan-in", "1,4", "--rounds", "2",
                           "--exact-fan-in", "1,4", "--processes", "2", "--warmup", "5", "--batches", "40",
                           "--idle", "0.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=160)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    for mode in ("plain", "exact"):
        part = result[mode]
        assert [(r["producers"], r["rounds"]) for r in part["rows"]] == [(1, 2), (4, 2)]
        assert [t["producers"] for t in part["trials"]] == [1, 4, 4, 1]  # interleaved, reversed every other round
        for row in part["rows"]:
            assert row["all_delivered"] and row["setup_s_max"] is not None, row
            assert 1 <= row["receive_threads"] <= 8 and row["cpu_ms_per_batch"] > 0, row
        assert part["rows"][0]["cpu_ratio_to_1"] == 1.0
        assert f"fan-in ({mode} mode)" in done.stdout
    for row in result["exact"]["rows"]:  # credits and reports go with the batches; liveness is counted apart
        assert row["control_sent_per_batch"] > 0 and row["liveness_sent_per_s_per_connection"] >= 0, row
