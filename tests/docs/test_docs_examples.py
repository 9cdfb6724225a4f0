"""Every code block in README.md and docs/*.md runs (Python) or parses (stoker command lines).

Python blocks run as written, each in a fresh interpreter, against real producer
processes, after the scale-down below: producer addresses become the test's
producers, 224 px images 32 px, batches of 64 batches of 8, and long loops a few
steps. Every substitution must apply to some block, so this table cannot drift
from the docs unnoticed. Bash blocks: every line that runs ``stoker`` is parsed
by the real argument parser, so a renamed flag fails here.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from stoker.cli.main import build_parser
from stoker.producer.process import ProducerProcess
from stoker.protocol import decode_batch

from conftest import unused_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SCALE_DOWN = [  # (pattern, replacement): docs numbers -> a run of seconds on two CPU cores
    (r"\b224\b", "32"), (r"\b64\b", "8"), (r"range\(1000\)", "range(3)"),
    (r"steps_per_epoch=1000", "steps_per_epoch=2"), (r"epochs=90", "epochs=1"),
]


def _blocks(language: str) -> list[tuple[str, str]]:
    """``(id, code)`` of every fenced block in ``language``, id = FILE:LINE."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _FENCE.finditer(text):
            if match.group(1) == language:
                found.append((f"{doc.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}", match.group(2)))
    return found


PYTHON_BLOCKS = _blocks("python")


def _scaled(code: str, hosts: dict[str, str]) -> str:
    for pattern, replacement in SCALE_DOWN:
        code = re.sub(pattern, replacement, code)
    for placeholder, endpoint in hosts.items():
        code = code.replace(placeholder, endpoint)
    return code


def test_every_scale_down_substitution_still_applies_to_the_docs():
    code = "\n".join(c for _, c in PYTHON_BLOCKS)
    assert len(PYTHON_BLOCKS) >= 4
    for pattern, _ in SCALE_DOWN:
        assert re.search(pattern, code), f"no docs example contains {pattern!r}: update SCALE_DOWN"


@pytest.fixture(scope="module")
def producers(synth_lmdb):
    args = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--seed", "1"]
    with ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "0/2"]) as a, \
            ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "1/2"]) as b:
        yield {"tcp://hostA:5555": a.endpoint, "tcp://hostB:5555": b.endpoint}


@contextlib.contextmanager
def _exact_producers(lmdb, code: str):
    """Exact-mode producers for the blocks that use them: endless ones for training (port 5556 in the
    docs), finite ones for evaluation (valA/valB), started per block since a finite run is used up."""
    hosts, running = {}, []
    try:
        for names, extra in ((("hostA", "hostB"), ["--exact"]), (("valA", "valB"), ["--mode", "eval", "--epochs", "1"])):
            port = 5556 if names[0] == "hostA" else 5555
            if f"tcp://{names[0]}:{port}" not in code:
                continue
            for i, name in enumerate(names):
                args = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--shard", f"{i}/2", *extra]
                running.append(ProducerProcess(lmdb, extra_args=args))
                hosts[f"tcp://{name}:{port}"] = running[-1].endpoint
        yield hosts
    finally:
        for producer in running:
            producer.stop()


@pytest.mark.parametrize("code", [c for _, c in PYTHON_BLOCKS], ids=[i for i, _ in PYTHON_BLOCKS])
def test_python_example_runs(code, producers, synth_lmdb, tmp_path):
    with _exact_producers(synth_lmdb, code) as exact:
        _run_python_example(code, {**producers, **exact}, tmp_path)


def _run_python_example(code: str, producers: dict[str, str], tmp_path) -> None:
    port = unused_port()
    hosts = {**producers, "tcp://*:5555": f"tcp://127.0.0.1:{port}"}
    receiver = None
    if "tcp://*:5555" in code:  # the example is a producer: be its trainer
        ctx = zmq.Context()
        receiver = ctx.socket(zmq.PULL)
        receiver.connect(f"tcp://127.0.0.1:{port}")
    try:
        out = subprocess.run([sys.executable, "-c", _scaled(code, hosts)], capture_output=True, text=True,
                             timeout=280, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                             "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert out.returncode == 0, out.stderr[-4000:]
        # Keras warns when from_logits=True meets a softmax output: the loss would be computed on probabilities.
        assert "Softmax activation" not in out.stderr, out.stderr[-4000:]
        if receiver is not None:
            assert receiver.poll(10000), "the example sent nothing"
            batch = decode_batch(receiver.recv_multipart())
            assert batch["images"].shape == (2, 4, 4, 3) and batch["labels"].tolist() == [3, 1]
    finally:
        if receiver is not None:
            receiver.close(0)
            ctx.term()


def _stoker_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for block_id, code in _blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;", line):
                words = shlex.split(part, comments=True)
                if words and Path(words[0]).name == "stoker":
                    commands.append((block_id, words[1:]))
    return commands


STOKER_COMMANDS = _stoker_commands()


@pytest.mark.parametrize("block_id, argv", STOKER_COMMANDS, ids=[f"{b}:{' '.join(a[:2])}" for b, a in STOKER_COMMANDS])
def test_documented_stoker_command_lines_parse(block_id, argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{block_id}: `stoker {' '.join(argv)}` does not parse (exit {exc.code})")


def test_the_docs_show_stoker_commands():
    assert len(STOKER_COMMANDS) >= 5
