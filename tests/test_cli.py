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


@pytest.mark.parametrize("command, message", [
    (["train", "--connect", "tcp://127.0.0.1:1", "--report", "/nonexistent-folder/run.html"],
     "folder /nonexistent-folder does not exist"),
    (["train", "--connect", "tcp://127.0.0.1:1", "--log-consumed", "/nonexistent-folder/steps.jsonl"],
     "folder /nonexistent-folder does not exist"),
    (["train", "--connect", "tcp://127.0.0.1:1", "--exact", "--trainer-id", "rank 0"], "printable ASCII"),
    (["doctor", "--connect", "tcp://127.0.0.1:1", "--report", "/nonexistent-folder/doctor.html"],
     "folder /nonexistent-folder does not exist"),
])
def test_outputs_written_at_the_end_of_a_run_are_checked_before_it_starts(command, message):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
