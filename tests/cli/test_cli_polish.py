"""What a new user reads first says each thing once, in words (issue 31, item 10): every --help, and the
producer's startup and summary lines."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.cli.main import build_parser
from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.producer.process import ProducerProcess


def _command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """``()``, ``("lmdb",)``, ``("lmdb", "build")``, ...: every command and subcommand the CLI has."""
    paths = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += _command_paths(sub, (*path, name))
    return paths


COMMAND_PATHS = _command_paths(build_parser())
_OPTION_START = re.compile(r"^  \S")  # an entry of an options/arguments section (help continues deeper)
# "(default: None)", "(default: False)", "(default: )", "(default: (0, 1))", "(default: ['a'])"
_PYTHON_DEFAULT = re.compile(r"\(default: (None|True|False|''|\"\"|)\)|\(default: [(\[{]")


def _option_entries(help_text: str) -> list[str]:
    """Each option's (and positional's) entry of a --help page, its wrapped lines joined into one line."""
    entries: list[list[str]] = []
    in_section = False
    for line in help_text.splitlines():
        if not line.strip():
            in_section = False
        elif not line.startswith(" "):
            in_section = line.rstrip().endswith(":")  # "options:", "positional arguments:"
        elif in_section and _OPTION_START.match(line):
            entries.append([line])
        elif in_section and entries:
            entries[-1].append(line)
    return [" ".join(" ".join(entry).split()) for entry in entries]


def test_the_walk_finds_every_subcommand():
    assert {("produce",), ("train",), ("lmdb", "build"), ("bench", "link"), ("keys", "generate")} <= set(COMMAND_PATHS)
    assert len(COMMAND_PATHS) >= 17


@pytest.mark.parametrize("command", COMMAND_PATHS, ids=lambda c: " ".join(c) or "stoker")
def test_help_names_each_default_once_and_never_as_a_python_value(command):
    # Issue 31.10a: `--seed` read "(default: random, logged) (default: None)", `--share` "(default: (0, 1))".
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command, "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    entries = _option_entries(out.stdout)
    assert entries, out.stdout
    for entry in entries:
        assert len(re.findall(r"\bdefault\b", entry, re.IGNORECASE)) <= 1, f"two defaults: {entry}"
        assert not _PYTHON_DEFAULT.search(entry), f"a Python value as the default: {entry}"
    assert "(default: None)" not in " ".join(out.stdout.split())


def _help_entry(command: list[str], flag: str) -> str:
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command, "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "100"})
    return next(entry for entry in _option_entries(out.stdout) if entry.startswith(flag + " "))


@pytest.mark.parametrize("command, flag, default", [
    (["produce"], "--seed", "(default: random, logged; with --shard auto: 0)"),
    (["produce"], "--shard", "(default: 0/1)"),
    (["train"], "--share", "(default: 0/1)"),
    (["lmdb", "build"], "--threads", "(default: CPU count)"),
    (["produce"], "--batch-size", "(default: 64)"),
])
def test_help_shows_each_default_as_a_user_types_it(command, flag, default):
    entry = _help_entry(command, flag)
    assert entry.endswith(default), entry


def test_share_given_as_text_still_parses_to_rank_and_world():
    assert build_parser().parse_args(["train", "--connect", "tcp://h:1"]).share == (0, 1)
    assert build_parser().parse_args(["train", "--connect", "tcp://h:1", "--share", "1/3"]).share == (1, 3)


# ---- the producer's startup and summary lines (issue 31.10b-d) ---------------------------------------------


@pytest.fixture(scope="module")
def ten_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Stoker LMDB of 10 records: --shard 0/2 holds 5 of them, --shard 0/10 one."""
    path = tmp_path_factory.mktemp("ten") / "ten"
    build_synthetic(path, 10, seed=3, num_classes=2, progress=False)
    return path


def _log_until_serving(lmdb: Path, log: Path, *flags: str) -> str:
    """The log of a real `stoker produce` from its start to serving (ProducerProcess waits for that, at most 60 s)."""
    with ProducerProcess(lmdb, extra_args=["--workers", "1", "--image-size", "32", *flags], start_timeout=60,
                         log_path=log):
        pass
    return log.read_text()


@pytest.fixture(scope="module")
def plain_log(ten_records: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _log_until_serving(ten_records, tmp_path_factory.mktemp("plain") / "produce.log",
                              "--shard", "0/2", "--batch-size", "64")


@pytest.fixture(scope="module")
def exact_log(ten_records: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _log_until_serving(ten_records, tmp_path_factory.mktemp("exact") / "produce.log",
                              "--shard", "0/10", "--batch-size", "4", "--epochs", "1")


def _line(log: str, text: str) -> str:
    return next((line for line in log.splitlines() if text in line), f"(no line with {text!r} in:\n{log})")


def test_produce_warns_when_the_batch_size_exceeds_its_shards_records_and_says_batches_repeat_them(plain_log):
    # Issue 31.10d: 10 records, --shard 0/2 (5 records), --batch-size 64 started without a word.
    warning = _line(plain_log, "WARNING")
    assert "shard 0/2" in warning and "holds 5 records, fewer than --batch-size 64" in warning, warning
    assert "runs over 13 epochs or more, so it holds records more than once" in warning, warning


def test_exact_produce_warns_that_batches_larger_than_the_shard_are_mostly_padding(exact_log):
    warning = _line(exact_log, "WARNING")
    assert "shard 0/10" in warning and "holds 1 record, fewer than --batch-size 4" in warning, warning
    # --epochs 1: the one record, once (endless: this epoch's and the next's)
    assert "a batch carries at most 1 sample and trainers cut its other rows off as padding" in warning, warning


def test_produce_startup_line_counts_in_words_a_person_reads(plain_log, exact_log):
    # Issue 31.10b: "1 workers" (and "1 records in shard").
    for log, records in ((plain_log, "5 records"), (exact_log, "1 record")):
        serving = _line(log, "serving ")
        assert f": {records} in shard" in serving and " 1 worker," in serving, serving
        assert "1 workers" not in serving and "1 records" not in serving, serving
    assert "exact, 1 epoch " in _line(exact_log, "serving "), exact_log


def test_produce_startup_line_shows_a_one_value_field_as_scalar_not_empty_brackets(plain_log):
    # Issue 31.10c: "labels int32 []" read as an empty array.
    serving = _line(plain_log, "serving ")
    assert "{images uint8 [32, 32, 3], labels int32 scalar}" in serving, serving
    assert "[]" not in serving


def test_counts_in_the_producers_lines_take_the_singular_for_one():
    from stoker.producer.serve.logs import counted

    assert [counted(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert counted(1, "batch", "batches") == "1 batch" and counted(3, "batch", "batches") == "3 batches"


def test_a_batch_mismatch_names_a_scalar_array_in_words():
    from stoker.protocol.batch_spec import ArrayShape, BatchMismatchError, BatchSpec

    assert str(ArrayShape("labels", "int32", ())) == "labels int32 scalar"
    assert str(ArrayShape("labels", "int32", (64,))) == "labels int32 [64]"
    want = BatchSpec.classification(2, (4, 4, 3))
    with pytest.raises(BatchMismatchError, match=r"sends images uint8 \[2, 4, 4, 3\], labels int32 scalar, "):
        want.check_declared("p", [("images", "uint8", [2, 4, 4, 3]), ("labels", "int32", []),
                                  ("index", "int64", [2]), ("epoch", "int32", [2])])
