"""One geometric augmentation for pixels and every target: crop, resize, flip of boxes and masks.

Boxes are ``float32 [n, 4]`` as ``(x1, y1, x2, y2)`` in pixels, x to the right and
y down, the box covering ``x1 <= x < x2``: the format is named, never guessed.
A ``Window`` is a crop ``(x, y, w, h)`` of the source image; ``crop_resize_flip``
maps source coordinates to the output image exactly as the pixels move, so a
drawn object stays inside its box and a mask stays on its shapes
(tests/producer/test_pipelines.py checks both on synthetic data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class Window:
    """A crop of the source image: top-left ``(x, y)``, size ``w`` x ``h`` pixels."""

    x: int
    y: int
    w: int
    h: int


def sanitize_boxes(boxes: np.ndarray, classes: np.ndarray, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Boxes clipped to the image, with non-finite and empty (zero-area) boxes dropped, and their classes."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    keep = np.isfinite(boxes).all(axis=1)
    boxes, classes = boxes[keep], np.asarray(classes)[keep]
    boxes = np.clip(boxes, 0, [width, height, width, height]).astype(np.float32)
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return boxes[keep], classes[keep]


def window_keeping_boxes(height: int, width: int, boxes: np.ndarray, rng: np.random.Generator,
                         min_scale: float = 0.3, ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Window:
    """A random crop window that contains every box whole.

    Its area is drawn from ``[min_scale, 1]`` of the image and its width/height
    log-uniformly from ``ratio``, then grown as needed to hold the union of the boxes,
    and placed uniformly among the positions that keep them all. No boxes: any window.
    """
    scale = rng.uniform(min_scale, 1.0)
    aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
    w = min(width, max(1, int(round(math.sqrt(height * width * scale * aspect)))))
    h = min(height, max(1, int(round(math.sqrt(height * width * scale / aspect)))))
    if len(boxes):
        ux1, uy1 = int(math.floor(boxes[:, 0].min())), int(math.floor(boxes[:, 1].min()))
        ux2, uy2 = int(math.ceil(boxes[:, 2].max())), int(math.ceil(boxes[:, 3].max()))
        w, h = max(w, ux2 - ux1), max(h, uy2 - uy1)
        x_lo, x_hi = max(0, ux2 - w), min(ux1, width - w)
        y_lo, y_hi = max(0, uy2 - h), min(uy1, height - h)
    else:
        x_lo, x_hi, y_lo, y_hi = 0, width - w, 0, height - h
    x = int(rng.integers(x_lo, x_hi + 1))
    y = int(rng.integers(y_lo, y_hi + 1))
    return Window(x, y, w, h)


def transform_boxes(boxes: np.ndarray, window: Window, out_h: int, out_w: int, flip: bool) -> np.ndarray:
    """Source-image boxes -> output-image boxes for a crop to ``window``, resize to ``out_h`` x ``out_w``, flip."""
    sx, sy = out_w / window.w, out_h / window.h
    moved = np.empty_like(boxes, dtype=np.float32)
    moved[:, 0] = (boxes[:, 0] - window.x) * sx
    moved[:, 2] = (boxes[:, 2] - window.x) * sx
    moved[:, 1] = (boxes[:, 1] - window.y) * sy
    moved[:, 3] = (boxes[:, 3] - window.y) * sy
    if flip:
        moved[:, [0, 2]] = out_w - moved[:, [2, 0]]
    return moved


def resize_window(image: np.ndarray, window: Window, out_h: int, out_w: int, nearest: bool, flip: bool,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Crop ``window`` of ``image``, resize to ``out_h`` x ``out_w`` (bilinear, or nearest for label masks), flip."""
    crop = image[window.y : window.y + window.h, window.x : window.x + window.w]
    interpolation = cv2.INTER_NEAREST if nearest else cv2.INTER_LINEAR
    if out is None:
        out = cv2.resize(crop, (out_w, out_h), interpolation=interpolation)
    else:
        cv2.resize(crop, (out_w, out_h), dst=out, interpolation=interpolation)
    if flip:
        cv2.flip(out, 1, dst=out)
    return out
