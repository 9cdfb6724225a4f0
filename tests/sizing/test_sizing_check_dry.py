"""benchmarks/sizing_check.py's dry mode (CPU, a small CNN): the script the GPU figures came from cannot rot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (CI installs it)")]


def test_the_sizing_check_reads_an_estimate_and_runs_the_pool_it_answers(tmp_path):
    out = tmp_path / "sizing.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sizing_check.py"), "--dry", "--producers", "1",
                           "--seconds", "3", "--out", str(out)], capture_output=True, text=True, timeout=200,
                          cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    first = result["phases"][0]
    assert first["producers"] == 1 and first["steps"] > 0 and first["fed_images_per_s"] > 0
    assert first["desired"] is not None, first  # the dry phase runs on until the estimate is read
    assert {p["producers"] for p in result["phases"][1:]} <= {first["desired"], first["desired"] - 1,
                                                              first["desired"] - 2}
    assert "producers | images/s | fed/const" in done.stdout
