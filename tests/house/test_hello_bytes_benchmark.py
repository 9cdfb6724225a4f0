"""benchmarks/hello_bytes.py on a small scale: the real hellos of a fixed-shard job, old against new, and the
projection to 10^9 records labelled as one. Keeps the benchmark from rotting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_a_small_run_shows_each_producer_gets_its_own_stream_and_projects_the_old_format(tmp_path):
    out = tmp_path / "hello_bytes.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hello_bytes.py"), "--records", "10000,100000",
                           "--producers", "4,8", "--out", str(out)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["records"], r["producers"]) for r in result["rows"]] == [(10**4, 4), (10**4, 8), (10**5, 4), (10**5, 8)]
    for row in result["rows"]:
        assert row["old_total"] == row["old_per_producer"] * row["producers"]
        # Each producer gets its shard's progress: the hellos together move about the state once, not P times.
        assert row["new_total"] * row["producers"] < 2 * row["old_total"], row
    assert [(p["records"], p["producers"]) for p in result["projected"]] == [(10**9, 4), (10**9, 8)]
    assert done.stdout.count("PROJECTED") == 2
