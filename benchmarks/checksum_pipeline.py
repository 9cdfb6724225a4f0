"""A pipeline whose output is known before it runs: each record's ``pixels`` field, unchanged.

``gpu_suite.py`` builds an LMDB of random ``pixels`` (``size`` x ``size`` x 3 bytes) and compares
what reaches the training device with checksums of those bytes, keyed by the record index that
travels with every batch. Any corruption, reordering of rows within a batch or mixing of two
batches shows up as a mismatch.

    stoker produce --lmdb checks.lmdb --pipeline benchmarks/checksum_pipeline.py:make_pipeline \
                   --pipeline-arg size=32
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stoker.producer.pipeline import Field, Pipeline


def checksum_weights(size: int) -> np.ndarray:
    """Position weights (1..251) of the checksum: a permuted or shifted image sums differently."""
    return (np.arange(size * size * 3, dtype=np.int64) % 251 + 1).reshape(size, size, 3)


def checksum(pixels: np.ndarray, weights: np.ndarray) -> int:
    """The checksum of one image: sum of pixel x position weight, in int64 (no overflow up to 4096 px)."""
    return int((pixels.astype(np.int64) * weights).sum())


def make_pipeline(size: int = 32) -> Pipeline:
    def sample(record, rng):
        pixels = np.frombuffer(record["pixels"], np.uint8)
        if pixels.size != size * size * 3:
            raise ValueError(f"field 'pixels' holds {pixels.size} bytes, expected {size * size * 3} "
                             f"({size} x {size} x 3): pass --pipeline-arg size= matching the dataset")
        return {"images": pixels.reshape(size, size, 3), "labels": record["label"]}

    return Pipeline([Field("images", "uint8", (size, size, 3)), Field("labels", "int32")], sample=sample)


def build_checksum_lmdb(path: Path, records: int, size: int) -> dict[int, int]:
    """An LMDB of random ``pixels`` and labels; returns record index -> checksum of its pixels."""
    from stoker.producer.dataset.build.write_records import write_lmdb

    rng = np.random.default_rng(0)
    weights = checksum_weights(size)
    images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(records)]
    write_lmdb(path, ({"pixels": im.tobytes(), "label": i % 10} for i, im in enumerate(images)),
               progress=False, total=records)
    return {i: checksum(im, weights) for i, im in enumerate(images)}
