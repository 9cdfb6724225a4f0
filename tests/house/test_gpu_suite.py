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
    torch_sections = ({"torch_correctness", "torch_latency", "torch_latency_bf16"} if importlib.util.find_spec("torch")
                      else set())
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
        for name, precision in (("torch_latency", "float32"), ("torch_latency_bf16", "bf16")):
            latency = sections[name]
            assert latency["precision"] == precision
            assert latency["overlap"]["where"] == "host" and latency["overlap"]["copy_events"] >= 3
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| one device | 96 | 0 |" in table and "| per replica | 192 | 0 |" in table and "Failed" not in table


#: ``sys.modules[name] = None``: the interpreter's own way to say a module is absent (import raises, find_spec is None).
BLOCK_TENSORFLOW = "import sys\nsys.modules['tensorflow'] = None\n"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the PyTorch sections need torch (CI installs it)")
def test_a_host_without_tensorflow_runs_the_other_sections_and_says_which_were_left_out(tmp_path):
    """A GPU host with PyTorch alone (the lent device machines have no TensorFlow): the suite does not refuse, it runs
    the PyTorch sections and says the TensorFlow ones were left out, and why; naming one of those is an error."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_TENSORFLOW)  # a real interpreter in which tensorflow is absent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    suite = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry", "--out-dir", str(tmp_path)]
    done = subprocess.run([*suite, "--sections", "torch_correctness,ingest"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert result["tensorflow"] is None and result["torch"]
    assert result["left_out"] == ["correctness, latency_float32, latency_mixed_float16: TensorFlow is not installed"]
    assert result["sections"]["torch_correctness"]["mismatches"] == 0
    ingest = result["sections"]["ingest"]["rows"]  # TorchInput measured against the bare loop; no ZMQInput columns
    assert [sorted(k for k in row if k.startswith(("torch", "zmq"))) for row in ingest] == [
        ["torch_cpu_ratio", "torch_cpu_s_per_gb", "torch_images_per_s", "torch_ratio"]]
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "Left out: correctness" in table and "TorchInput img/s" in table and "ZMQInput" not in table
    refused = subprocess.run([*suite, "--sections", "correctness"], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "TensorFlow is not installed" in refused.stderr
