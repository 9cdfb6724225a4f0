"""Deterministic synthetic JPEG datasets for the demo, tests and benchmarks.

Machines here cannot download ImageNet, so we make photo-like JPEGs: smooth
colour fields, class-coloured shapes and sensor-like noise, 300-500 px a side,
JPEG quality 90, which lands near ImageNet's ~110 KB average file size. The
class is visible in the image (its hue and shapes), so a small CNN can learn it.
The same (seed, index) always yields the same bytes with the same OpenCV build.
"""

from __future__ import annotations

import colorsys
import os

import cv2
import numpy as np
from tqdm import tqdm

from .dataset_format import DatasetMeta
from .dataset_writer import DatasetWriter


def synthetic_image(seed: int, index: int, num_classes: int, min_side: int = 300, max_side: int = 500) -> tuple[np.ndarray, int]:
    """Return ``(bgr_uint8_image, label)`` for record ``index`` of a synthetic dataset."""
    rng = np.random.default_rng([seed, index])
    label = index % num_classes
    h, w = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
    # Smooth background: a few random colours upsampled bicubically.
    coarse = rng.integers(0, 256, size=(4, 4, 3)).astype(np.float32)
    image = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
    hue = label / num_classes
    for _ in range(int(rng.integers(3, 8))):
        r, g, b = colorsys.hsv_to_rgb((hue + rng.normal(0, 0.03)) % 1.0, rng.uniform(0.5, 1.0), rng.uniform(0.4, 1.0))
        colour = (b * 255, g * 255, r * 255)
        centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        axes = (int(rng.integers(w // 10, w // 3)), int(rng.integers(h // 10, h // 3)))
        if label % 2:
            cv2.ellipse(image, centre, axes, float(rng.uniform(0, 180)), 0, 360, colour, -1, cv2.LINE_AA)
        else:
            cv2.rectangle(image, (centre[0] - axes[0], centre[1] - axes[1]), (centre[0] + axes[0], centre[1] + axes[1]), colour, -1, cv2.LINE_AA)
    # Texture: blurred noise (surfaces) plus fine noise (sensor) gives photo-like JPEG sizes.
    texture = cv2.GaussianBlur(rng.normal(0, 40, size=(h, w)).astype(np.float32), (0, 0), 0.6)[:, :, None]
    image += texture + rng.normal(0, 16, size=(h, w, 3)).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8), label


def synthetic_jpeg(seed: int, index: int, num_classes: int, quality: int = 90) -> tuple[bytes, int]:
    image, label = synthetic_image(seed, index, num_classes)
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("OpenCV failed to encode a synthetic JPEG")
    return encoded.tobytes(), label


def build_synthetic(
    out: str | os.PathLike,
    count: int,
    seed: int = 0,
    num_classes: int = 10,
    overwrite: bool = False,
    progress: bool = True,
) -> DatasetMeta:
    """Write a synthetic Stoker LMDB of ``count`` JPEGs to ``out`` (see module doc)."""
    if count <= 0:
        raise ValueError("count must be positive")
    with DatasetWriter(out, overwrite=overwrite) as writer:
        for index in tqdm(range(count), desc="synth", unit="img", disable=not progress):
            data, label = synthetic_jpeg(seed, index, num_classes)
            writer.add(label, data)
        return writer.finish([f"class_{c:03d}" for c in range(num_classes)])
