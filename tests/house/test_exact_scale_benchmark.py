"""benchmarks/exact_scale.py on a small scale: the trainer's real bookkeeping at 10^5 and 10^10 records, in epoch
order 2 and the old format. Keeps the benchmark from rotting, and checks what it claims is flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_a_small_run_keeps_order_2_state_the_same_at_10_to_the_5_and_10_to_the_10_records(tmp_path):
    out = tmp_path / "exact_scale.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "exact_scale.py"), "--producers", "8",
                           "--sizes", "1e7,1e10", "--world-sizes", "1e10", "--old-sizes", "1e5", "--out", str(out)],
                          capture_output=True, text=True, timeout=200, cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["records"], r["epoch_order"], r["world"]) for r in rows] == [(10**7, 2, 1), (10**10, 2, 1),
                                                                             (10**10, 2, 2), (10**5, 1, 1)]
    small, large, shared, old = rows
    assert small["rows_served"] == large["rows_served"] > 0
    # What is in flight is the same, so the state is: ranges of positions, not a bit per record.
    assert abs(large["state_bytes"] - small["state_bytes"]) < 64 and large["open_ranges"] == small["open_ranges"]
    # Rank 0 of 2: its share is blocks of splits, so half of it consumed is a few thousand ranges, not one a split.
    assert shared["open_ranges"] < 5000 and shared["state_bytes"] < 64 * 1024
    assert old["open_ranges"] is None and old["state_bytes"] > 0
