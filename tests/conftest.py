"""Shared fixtures: real LMDB files on disk, real producer processes."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest

from stoker.producer.dataset.build.synthetic import build_synthetic

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


def stoker_batch(images: np.ndarray, labels: np.ndarray, first_index: int = 0) -> dict[str, np.ndarray]:
    """What a Stoker imagenet producer sends: images, labels, and the index and epoch of each row."""
    n = len(labels)
    return {"images": images, "labels": np.asarray(labels, np.int32),
            "index": np.arange(first_index, first_index + n, dtype=np.int64), "epoch": np.zeros(n, np.int32)}
