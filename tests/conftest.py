"""Shared fixtures: real LMDB files on disk, real producer processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stoker.producer.synthetic import build_synthetic

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
