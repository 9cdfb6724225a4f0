"""benchmarks/partition.py on a small scale: 16 pool endpoints in 2 processes, 4 trainer processes reading 4 each.
Keeps the benchmark from rotting; no figure is held to a threshold, but its record check must hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_a_small_partitioned_job_serves_every_record_once_and_reports_its_figures(tmp_path):
    out = tmp_path / "partition.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "partition.py"), "--producers", "16",
                           "--trainers", "4", "--per-trainer", "4", "--processes", "2", "--records", "512",
                           "--epoch-order", "1", "--out", str(out)], capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    job = result["job"]
    assert (job["records"], job["records_once"], job["records_never"], job["records_twice_or_more"]) == \
        (16 * 512, 16 * 512, 0, 0)
    assert job["connections_asked"] == 16 and job["connections_full_fan_in"] == 64
    assert job["readers_per_producer"] == [1] and job["producers_served"] == 16
    for trainer in job["trainers"]:
        assert trainer["producers"] == 4 and len(trainer["producers_seen"]) == 4, trainer
        assert trainer["cpu_ms_per_batch"] > 0 and 1 <= trainer["receive_threads"] <= 8, trainer
    assert "partitioned pool: 4 trainers x 4 of 16 producers" in done.stdout
