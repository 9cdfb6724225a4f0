"""Deterministic synthetic datasets for the demo, tests and benchmarks, one per task.

Machines here cannot download ImageNet, so we make photo-like JPEGs: smooth
colour fields, class-coloured shapes and sensor-like noise, 300-500 px a side,
JPEG quality 90, which lands near ImageNet's ~110 KB average file size.

- classification: the class is visible in the image (its hue and shapes), so a
  small CNN can learn it. Records ``{"image", "label"}``.
- detection: 1-6 solid objects of class-coloured hues on a grey-ish textured
  background, never overlapping; ``boxes`` (float32 [n, 4], x1 y1 x2 y2 pixels) are
  the drawn shapes' exact bounding boxes and ``classes`` (int32 [n]) their classes.
- segmentation: the same scenes; ``mask`` is an 8-bit PNG of class id + 1 per
  pixel (0: background) drawn with the same shapes as the image, pixel for pixel.

The same (seed, index) always yields the same bytes with the same OpenCV build.
"""

from __future__ import annotations

import colorsys
import os
from typing import Optional

import cv2
import numpy as np
from tqdm import tqdm

from stoker.producer.dataset.sources.lmdb_format import DatasetMeta
from stoker.producer.dataset.build.sharded_writer import open_writer


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


TASKS = ("classification", "detection", "segmentation")


def class_colour(label: int, num_classes: int) -> tuple[float, float, float]:
    """The vivid BGR colour objects of class ``label`` are drawn in (distinct hues)."""
    r, g, b = colorsys.hsv_to_rgb(label / num_classes, 0.9, 0.95)
    return b * 255, g * 255, r * 255


def synthetic_scene(seed: int, index: int, num_classes: int, min_side: int = 300, max_side: int = 500,
                    max_objects: int = 6) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(bgr image, boxes float32 [n, 4], classes int32 [n], label map uint8)`` of a detection scene.

    The label map holds class + 1 where object pixels are, 0 elsewhere; it and the image are drawn
    with the same shapes (no anti-aliasing), so they agree pixel for pixel before JPEG encoding.
    """
    rng = np.random.default_rng([seed, index, 1])
    h, w = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
    grey = rng.integers(70, 180, size=(4, 4, 1)).astype(np.float32) + rng.normal(0, 12, size=(4, 4, 3))
    image = cv2.resize(grey.astype(np.float32), (w, h), interpolation=cv2.INTER_CUBIC)
    image += cv2.GaussianBlur(rng.normal(0, 25, size=(h, w)).astype(np.float32), (0, 0), 0.8)[:, :, None]
    label_map = np.zeros((h, w), np.uint8)
    boxes, classes = [], []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        label = int(rng.integers(0, num_classes))
        for _try in range(30):
            ow, oh = int(rng.integers(w // 10, w // 3)), int(rng.integers(h // 10, h // 3))
            x, y = int(rng.integers(0, w - ow)), int(rng.integers(0, h - oh))
            if not label_map[max(0, y - 2) : y + oh + 2, max(0, x - 2) : x + ow + 2].any():
                break
        else:
            continue  # no free place for it: fewer objects
        shape = np.zeros((h, w), np.uint8)
        if rng.random() < 0.5:
            cv2.rectangle(shape, (x, y), (x + ow - 1, y + oh - 1), 1, -1, cv2.LINE_8)
        else:
            cv2.ellipse(shape, (x + ow // 2, y + oh // 2), (ow // 2, oh // 2), 0, 0, 360, 1, -1, cv2.LINE_8)
        ys, xs = np.nonzero(shape)
        label_map[shape > 0] = label + 1
        image[shape > 0] = class_colour(label, num_classes)
        boxes.append([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
        classes.append(label)
    image += rng.normal(0, 6, size=(h, w, 3)).astype(np.float32)
    return (np.clip(image, 0, 255).astype(np.uint8), np.asarray(boxes, np.float32).reshape(-1, 4),
            np.asarray(classes, np.int32), label_map)


def synthetic_record(task: str, seed: int, index: int, num_classes: int) -> dict:
    """Record ``index`` of a synthetic ``task`` dataset (see the module doc)."""
    if task == "classification":
        data, label = synthetic_jpeg(seed, index, num_classes)
        return {"image": data, "label": label}
    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose one of {', '.join(TASKS)}")
    image, boxes, classes, label_map = synthetic_scene(seed, index, num_classes)
    ok, jpeg = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    if task == "detection":
        return {"image": jpeg.tobytes(), "boxes": boxes, "classes": classes}
    ok, png = cv2.imencode(".png", label_map)
    return {"image": jpeg.tobytes(), "mask": png.tobytes()}


def build_synthetic(
    out: str | os.PathLike,
    count: int,
    seed: int = 0,
    num_classes: int = 10,
    overwrite: bool = False,
    progress: bool = True,
    task: str = "classification",
    shard_bytes: Optional[int] = None,
) -> DatasetMeta:
    """Write a synthetic Stoker LMDB of ``count`` records for ``task`` to ``out`` (see module doc); with
    ``shard_bytes``, a sharded dataset of shards of about that size (``sharded_writer.py``)."""
    if count <= 0:
        raise ValueError("count must be positive")
    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose one of {', '.join(TASKS)}")
    classes = [f"class_{c:03d}" for c in range(num_classes)]
    with open_writer(out, shard_bytes, classes, overwrite=overwrite) as writer:
        for index in tqdm(range(count), desc=f"synth {task}", unit="rec", disable=not progress):
            writer.add(synthetic_record(task, seed, index, num_classes))
        return writer.finish(classes, task=task, info={"synthetic": True, "seed": seed})
