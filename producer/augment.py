"""Decode and augment one encoded image into a fixed-size RGB uint8 array.

train: random-resized-crop (area scale 0.08-1, aspect ratio 3/4-4/3, the
    Inception/torchvision recipe, 10 tries then a centre crop) and a random
    horizontal flip.
eval: resize the short side to ``size / 0.875`` (256 for 224), centre crop.
    Deterministic.

Both write into a caller-provided ``out`` slot (e.g. one row of a batch) so a
batch is assembled with no extra copy. Decoding errors raise DecodeError.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875


class DecodeError(ValueError):
    """The bytes do not decode to an image."""


def decode_bgr(data: bytes) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if image is None or image.ndim != 3 or image.shape[0] == 0 or image.shape[1] == 0:
        raise DecodeError("OpenCV cannot decode the image bytes")
    return image


def random_crop_window(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """``(y, x, h, w)`` of a random-resized-crop window, torchvision's algorithm."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            y = int(rng.integers(0, height - h + 1))
            x = int(rng.integers(0, width - w + 1))
            return y, x, h, w
    # Fallback: the largest centred crop within the ratio bounds.
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        h, w = height, int(round(height * RATIO[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def train_transform(bgr: np.ndarray, size: int, rng: np.random.Generator, out: np.ndarray) -> None:
    """Random-resized-crop + random flip of a BGR image into ``out`` (size x size x 3, RGB)."""
    y, x, h, w = random_crop_window(bgr.shape[0], bgr.shape[1], rng)
    crop = bgr[y : y + h, x : x + w]
    resized = cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        resized = resized[:, ::-1]
    out[...] = resized[:, :, ::-1]


def eval_transform(bgr: np.ndarray, size: int, out: np.ndarray) -> None:
    """Resize short side to ``round(size / 0.875)`` then centre-crop ``size`` into ``out`` (RGB)."""
    h, w = bgr.shape[:2]
    short = int(round(size / EVAL_CROP_FRACTION))
    if h <= w:
        new_h, new_w = short, max(size, int(round(w * short / h)))
    else:
        new_h, new_w = max(size, int(round(h * short / w))), short
    resized = cv2.resize(bgr, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    out[...] = resized[top : top + size, left : left + size, ::-1]
