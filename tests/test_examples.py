"""The examples in examples/ run, end to end, against real producers (short runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


NEEDS = {"torch_ddp": "torch", "torch_lightning": "lightning"}  # extras .ci/run installs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_example_trains_to_the_end(example, tmp_path):
    if example.stem in NEEDS and not os.environ.get("CI"):  # CI has every extra: there a missing one fails
        pytest.importorskip(NEEDS[example.stem], reason=f"the stoker[{NEEDS[example.stem]}] extra is not installed")
    out = subprocess.run([sys.executable, str(example), "--steps", "12", "--records", "32"], capture_output=True,
                         text=True, timeout=280, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
                              "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert "final loss" in out.stdout
    if example.stem == "torch_lightning":  # resumed from Lightning's checkpoint: each record trained on once
        assert "times each record of them was trained on: [1]; records per epoch: [32, 32]" in out.stdout
    assert not list(tmp_path.glob("stoker-example-*")), "the example left its data behind"


def test_there_are_the_examples():
    assert {e.stem for e in EXAMPLES} >= {"custom_augmentation", "detection", "segmentation", "jax_training",
                                          "torch_ddp", "torch_lightning"}
