"""The GPU suite's dry mode: every section of benchmarks/gpu_suite.py runs on CPU devices, so the
one command a lent GPU machine runs cannot rot unnoticed. Real producers, real TensorFlow."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_dry_mode_runs_every_section_and_the_staged_batches_equal_what_the_producers_sent(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = result["sections"]
    torch_sections = {"torch_correctness", "torch_latency"} if importlib.util.find_spec("torch") else set()
    assert os.environ.get("CI") is None or torch_sections, "CI installs the torch extra (.ci/run)"
    assert set(sections) == {"correctness", "latency_float32", "latency_mixed_float16", "scaling", "ingest",
                             *torch_sections}
    assert all(s["ok"] for s in sections.values()), sections
    check = sections["correctness"]
    # Every checked row's checksum, taken on the device it was staged on, matched the dataset's bytes.
    assert check["one_device"]["samples"] == 12 * 8 and check["one_device"]["mismatches"] == 0
    assert check["per_replica"]["samples"] == 2 * 12 * 8 and check["per_replica"]["mismatches"] == 0
    assert [d.split("device:")[-1] for d in check["per_replica"]["unstage_devices"]] == ["CPU:0", "CPU:1"]
    for precision in ("float32", "mixed_float16"):
        latency = sections[f"latency_{precision}"]
        assert latency["precision"] == precision and len(latency["rounds"]["zmq_s"]) == 1
        # A real profiler trace, parsed: the StagingArea's Stage ops found on the host plane.
        assert latency["overlap"]["where"] == "host" and latency["overlap"]["copy_events"] >= 3
    assert [r["workers"] for r in sections["scaling"]["rows"]] == result["plan"]["workers"]
    assert [r["producers"] for r in sections["ingest"]["rows"]] == [1]
    if torch_sections:  # TorchInput's batches checksummed where they were handed out; a real torch.profiler trace
        check = sections["torch_correctness"]
        assert (check["samples"], check["mismatches"], check["tensor_devices"]) == (12 * 8, 0, ["cpu"])
        latency = sections["torch_latency"]
        assert latency["overlap"]["where"] == "host" and latency["overlap"]["copy_events"] >= 3
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| one device | 96 | 0 |" in table and "| per replica | 192 | 0 |" in table and "Failed" not in table
