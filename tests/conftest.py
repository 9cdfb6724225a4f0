"""Shared fixtures and helpers for every wing's tests: real LMDB files on disk, real producer processes, ports,
the ``stoker`` command, the exactly-once check. Tests import the helpers with ``from conftest import ...``
(pytest puts this folder on ``sys.path``), as they do ``hostile_peer`` and ``image_samples`` beside it."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import cv2
import numpy as np
import pytest

from stoker.producer.dataset.build.synthetic import build_synthetic

if TYPE_CHECKING:
    from stoker.producer.process import ProducerProcess

ROOT = Path(__file__).resolve().parents[1]

SYNTH_COUNT = 96
SYNTH_CLASSES = 4


@pytest.fixture(scope="session")
def synth_lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real synthetic Stoker LMDB of 96 JPEGs in 4 classes, built once per session."""
    path = tmp_path_factory.mktemp("data") / "synth"
    build_synthetic(path, SYNTH_COUNT, seed=7, num_classes=SYNTH_CLASSES, progress=False)
    return path


@pytest.fixture(autouse=True)
def _quiet_tf() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


EVAL_SIZE = 32
CHECKSUM_WEIGHTS = np.random.default_rng(1234).integers(1, 2**20, size=(EVAL_SIZE, EVAL_SIZE, 3), dtype=np.int64)


def expected_eval_image(data: bytes, size: int = EVAL_SIZE) -> np.ndarray:
    """The eval transform written out independently of stoker.producer.images.augment."""
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    h, w = bgr.shape[:2]
    short = round(size / 0.875)
    new_w, new_h = (max(size, round(w * short / h)), short) if h <= w else (short, max(size, round(h * short / w)))
    resized = cv2.resize(bgr, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return np.ascontiguousarray(resized[top:top + size, left:left + size, ::-1])


def image_checksums(images: np.ndarray) -> list[int]:
    """Position-weighted checksums of a uint8 [B, 32, 32, 3] batch (identify records with high probability)."""
    return [int(c) for c in (images.astype(np.int64) * CHECKSUM_WEIGHTS).sum(axis=(1, 2, 3))]


@pytest.fixture(scope="session")
def record_by_checksum(synth_lmdb: Path) -> dict[int, tuple[int, int]]:
    """Checksum of each record's expected 32 px eval image -> (record index, label)."""
    from stoker.producer.dataset.sources import LmdbDataset

    table = {}
    with LmdbDataset(synth_lmdb) as ds:
        for index in range(len(ds)):
            record = ds.read(index)
            label, data = record["label"], record["image"]
            table[image_checksums(expected_eval_image(data)[None])[0]] = (index, label)
    assert len(table) == SYNTH_COUNT, "checksums must identify records"
    return table


def random_jpeg(seed: int, shape: tuple[int, int, int]) -> bytes:
    """A JPEG of seeded noise of ``shape`` (height, width, 3): the same bytes for the same seed."""
    image = np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


def stoker_batch(images: np.ndarray, labels: np.ndarray, first_index: int = 0) -> dict[str, np.ndarray]:
    """What a Stoker imagenet producer sends: images, labels, and the index and epoch of each row."""
    n = len(labels)
    return {"images": images, "labels": np.asarray(labels, np.int32),
            "index": np.arange(first_index, first_index + n, dtype=np.int64), "epoch": np.zeros(n, np.int32)}


def one_worker_producer(dataset: str | os.PathLike, *extra: str, batch: int, size: int = EVAL_SIZE,
                        flags: Sequence[str] = (), **process_args: Any) -> ProducerProcess:
    """A producer daemon of one worker serving ``batch``-row batches of ``size`` px images, not yet started
    (use it in ``with``): ``flags`` then ``extra`` add to its command line, ``process_args`` go to
    ``ProducerProcess`` (``bind``, ``env``, ...)."""
    from stoker.producer.process import ProducerProcess

    args = ["--workers", "1", "--batch-size", str(batch), "--image-size", str(size), *flags, *extra]
    return ProducerProcess(dataset, extra_args=args, **process_args)


def count_rows(batch: dict[str, np.ndarray], seen: Counter) -> None:
    """Add each row of ``batch`` to ``seen``, keyed by its (epoch, index)."""
    for e, i in zip(batch["epoch"].tolist(), batch["index"].tolist()):
        seen[(e, i)] += 1


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released): free to bind, and a connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stoker_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``stoker ARGS...`` run to its end by this interpreter, its output captured as text; the caller checks the
    exit code (``benchmarks/harness.run_stoker`` raises instead, for benchmarks that only need it to succeed)."""
    return subprocess.run([sys.executable, "-m", "stoker.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_exactly_once(rows: Iterable[Sequence[int]], records: set[int]) -> None:
    """Every record of ``records`` in ``rows`` (``(epoch, index)`` pairs, all of epoch 0) exactly once."""
    rows = list(rows)
    counts = Counter(index for epoch, index in rows)
    assert {epoch for epoch, _ in rows} <= {0}
    assert set(counts) == records, f"missing {sorted(records - set(counts))}, extra {sorted(set(counts) - records)}"
    assert set(counts.values()) == {1}, f"seen twice: {sorted(i for i, n in counts.items() if n > 1)}"


def wait_for_producer_log(producer: ProducerProcess, texts: tuple[str, ...], seconds: float = 30) -> str:
    """The producer's log once it contains one of ``texts`` (its main loop drains the monitor every 0.5 s)."""
    deadline = time.monotonic() + seconds
    while not any(text in producer.log_text() for text in texts):
        assert time.monotonic() < deadline, f"none of {texts} in the producer log:\n{producer.log_text()[-2000:]}"
        time.sleep(0.1)
    return producer.log_text()


def required_tool(name: str, found: str | None, fix: str = ".ci/run installs it") -> str:
    """``found``, the path of a tool a test needs; when it is None the test skips, or fails in CI (CI=true, set
    by the CI runner), where a missing tool is a broken set-up."""
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; {fix}")
        pytest.skip(f"{name} is not installed ({fix})")
    return found


def installed_tool(name: str) -> str:
    """The path of a command-line validator on PATH or beside this interpreter (a pip-installed one)."""
    return required_tool(name, shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent)))


@functools.cache
def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` loaded by path, once per session (e.g. ``local_s3``, the one SeaweedFS launcher
    the benchmarks use too)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def promql_selectors(node: Any) -> list:
    """Every vector selector in an expression ``promql_parser.parse`` gave, through calls, aggregations and
    subqueries (the dashboard's and the autoscaler's queries are checked against the metrics we export)."""
    import promql_parser

    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    found = []
    for attr in ("lhs", "rhs", "expr", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None:
            found += promql_selectors(child)
    for arg in getattr(node, "args", None) or []:
        found += promql_selectors(arg)
    return found
