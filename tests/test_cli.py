"""Every command explains itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = [[], ["lmdb"], ["lmdb", "build"], ["lmdb", "synth"], ["lmdb", "info"], ["produce"], ["train"], ["demo"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "stoker")
def test_help_explains_every_option_with_its_default(command):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: stoker" in out.stdout
    if command in (["produce"], ["train"], ["demo"], ["lmdb", "synth"]):
        assert "(default:" in out.stdout


def test_produce_help_documents_the_batch_format():
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "produce", "--help"],
                         capture_output=True, text=True, timeout=60)
    for flag in ("--lmdb", "--bind", "--workers", "--batch-size", "--image-size", "--mode", "--shard", "--seed"):
        assert flag in out.stdout
    assert "uint8 [B,H,W,3]" in out.stdout
