"""The PyTorch benchmarks run and report what they claim to measure (tiny sizes; no figure is judged here:
targets live in the benchmarks' own tables, docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # CI installs the extra (.ci/run): there a missing torch fails the run
    pytest.importorskip("torch", reason="the stoker[torch] extra is not installed (.ci/run installs it)")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_dataloader_comparison_reports_both_inputs_from_interleaved_rounds(tmp_path):
    out = tmp_path / "dl.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_dataloader.py"), "--records", "32",
                           "--image-size", "32", "--batch-size", "8", "--warmup", "2", "--batches", "3", "--rounds", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rounds"]["dataloader"]) == len(result["rounds"]["stoker"]) == 2
    assert result["dataloader_images_per_s"] > 0 and result["stoker_images_per_s"] > 0
    assert result["stoker_producer_cpu_s_per_batch"] > 0  # the producers' work is counted, apart from the trainer's
    assert "Stoker -> TorchInput" in done.stdout
