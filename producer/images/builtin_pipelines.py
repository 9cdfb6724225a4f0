"""The pipelines ``stoker produce --pipeline NAME`` runs without user code: imagenet, detection, segmentation.

Each is a factory returning a ``Pipeline``; every argument can be set with
``--pipeline-arg KEY=VALUE`` and ``mode``/``image_size`` come from ``--mode`` and
``--image-size``. Sizes are ``"224"`` (square) or ``"HxW"`` (``"224x320"``);
ranges are ``"lo,hi"``. Record fields are named by the ``*_field`` arguments
(docs/format.md); Python callers may pass tuples instead of strings.

- ``imagenet``: train: random-resized-crop (area ``scale``, aspect ``ratio``) and a
  horizontal flip, decoding only the crop window of a JPEG; eval: resize so the
  centre ``eval_crop`` fraction covers the output, centre crop. Writes straight
  into the batch row (``fill``): no copy.
- ``detection``: image, boxes ``float32 [<=max_boxes, 4]`` (x1, y1, x2, y2 in
  output pixels) and classes ``int32 [<=max_boxes]``. Train: a random crop that
  keeps every box whole (area at least ``min_scale``), resize, flip; eval: resize.
  Boxes are clipped to the image and empty ones dropped with their classes.
- ``segmentation``: image and a ``uint8`` class-id mask (an encoded PNG or an
  array, the image's size) through the same random-resized-crop, resize (mask:
  nearest neighbour) and flip; eval: resize.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence, Union

import cv2
import numpy as np

from stoker.producer.images.augment import CROP_DECODING, EVAL_CROP_FRACTION, RATIO, SCALE, decode_train_crop, eval_transform, \
    random_crop_window, resize_flip_into
from stoker.producer.images.geometry import Window, resize_window, sanitize_boxes, transform_boxes, window_keeping_boxes
from stoker.producer.images.decode import DecodeError, decode_rgb, read_image_info
from stoker.producer.pipeline import Field, Pipeline, PipelineError, SampleError, upto

Pair = Union[str, Sequence[float]]


def parse_size(size: Union[str, int, Sequence[int]], default: int) -> tuple[int, int]:
    """``"224"``, ``"224x320"`` (height x width), an int or a pair -> ``(height, width)``."""
    if size in ("", None):
        size = default
    if isinstance(size, str):
        parts = size.lower().replace(" ", "").split("x")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise PipelineError(f"size {size!r}: expected N or HxW, e.g. 224 or 224x320") from None
        height, width = (values[0], values[0]) if len(values) == 1 else values if len(values) == 2 else (0, 0)
    elif isinstance(size, (int, np.integer)):
        height = width = int(size)
    else:
        height, width = (int(v) for v in size)
    if min(height, width) < 8:
        raise PipelineError(f"size {size!r}: height and width must be at least 8 pixels")
    return height, width


def parse_range(value: Pair, name: str, low: float = 0.0, high: float = float("inf")) -> tuple[float, float]:
    """``"0.08,1"`` or a pair -> ``(lo, hi)`` with ``low <= lo <= hi <= high``."""
    try:
        lo, hi = (float(v) for v in (value.split(",") if isinstance(value, str) else value))
    except (ValueError, TypeError):
        raise PipelineError(f"{name} {value!r}: expected two numbers lo,hi") from None
    if not low <= lo <= hi <= high:
        raise PipelineError(f"{name} {value!r}: need {low} <= lo <= hi <= {high}")
    return lo, hi


def train_mode(mode: str) -> bool:
    """True for ``"train"``, False for ``"eval"``; PipelineError for anything else."""
    if mode not in ("train", "eval"):
        raise PipelineError(f"mode must be train or eval, got {mode!r}")
    return mode == "train"


def class_label(record: Mapping[str, Any], field: str) -> int:
    """The class index in ``record[field]``; SampleError naming the field unless it is an int in [0, 2^31)."""
    label = record.get(field)
    if not isinstance(label, (int, np.integer)) or isinstance(label, bool) or not 0 <= int(label) < 2**31:
        raise SampleError(f"record field {field!r} is {label!r}, expected a class index >= 0")
    return int(label)


def encoded_image(record: Mapping[str, Any], field: str) -> bytes:
    """The encoded image bytes in ``record[field]``; SampleError naming the field when there are none."""
    data = record.get(field)
    if not isinstance(data, (bytes, bytearray, memoryview)) or not len(data):
        raise SampleError(f"record field {field!r} holds no encoded image bytes (got {type(data).__name__})")
    return bytes(data)


class DecodeClock:
    """Seconds spent decoding, for the producer's per-stage metrics (``Pipeline.stage_times``)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, 0.0
        return {"decode": seconds}


class ImagenetImage:
    """The imagenet pipeline's image step, shared by every pipeline that wants its pixels so (``image_text``).

    Train: random-resized-crop (area ``scale``, aspect ``ratio``; with ``crop_decoding`` only the crop window of a
    JPEG is decoded) and a horizontal flip; eval: resize so the centre ``eval_crop`` fraction covers the output,
    centre crop. The arguments are checked here (PipelineError); ``field`` is the ``images`` field it fills and
    ``stage_times`` the seconds spent decoding since last asked.
    """

    def __init__(self, mode: str, image_size: int, size: str, scale: Pair, ratio: Pair, flip: bool,
                 eval_crop: float, fast_dct: bool, crop_decoding: bool, image_field: str) -> None:
        self.train = train_mode(mode)
        self.height, self.width = parse_size(size, image_size)
        self.scale = parse_range(scale, "scale", 0.0, 1.0)
        self.ratio = parse_range(ratio, "ratio", 1e-3)
        if not 0 < eval_crop <= 1:
            raise PipelineError(f"eval_crop {eval_crop}: must be in (0, 1]")
        self.flip, self.eval_crop, self.fast_dct, self.crop_decoding = flip, eval_crop, fast_dct, crop_decoding
        self.image_field = image_field
        self.field = Field("images", "uint8", (self.height, self.width, 3))
        self._clock = DecodeClock()
        self.stage_times = self._clock.take

    def into(self, data: bytes, rng: np.random.Generator, out: np.ndarray) -> None:
        """Decode ``data`` and write its transformed pixels into the ``uint8 [H, W, 3]`` row ``out``; SampleError
        naming the image field when the bytes do not decode."""
        size = (self.height, self.width)
        t0 = time.perf_counter()
        try:
            pixels = (decode_train_crop(data, rng, self.fast_dct, self.crop_decoding, self.scale, self.ratio)
                      if self.train else decode_rgb(data, self.fast_dct))
        except DecodeError as exc:
            raise SampleError(f"record field {self.image_field!r}: {exc}") from None
        self._clock.seconds += time.perf_counter() - t0
        if self.train:
            resize_flip_into(pixels, size, rng, out, self.flip)
        else:
            eval_transform(pixels, size, out, self.eval_crop)


def make_imagenet(mode: str = "train", image_size: int = 224, size: str = "", scale: Pair = SCALE,
                  ratio: Pair = RATIO, flip: bool = True, eval_crop: float = EVAL_CROP_FRACTION,
                  fast_dct: bool = False, crop_decoding: bool = CROP_DECODING, image_field: str = "image",
                  label_field: str = "label") -> Pipeline:
    """ImageNet-style classification: ``images uint8 [H, W, 3]`` (RGB) and ``labels int32 scalar`` (one per image)."""
    image = ImagenetImage(mode, image_size, size, scale, ratio, flip, eval_crop, fast_dct, crop_decoding,
                          image_field)

    def fill(record: Mapping[str, Any], rng: np.random.Generator, rows: dict[str, np.ndarray]) -> None:
        data = encoded_image(record, image_field)
        label = class_label(record, label_field)
        image.into(data, rng, rows["images"])
        rows["labels"][...] = label

    return Pipeline([image.field, Field("labels", "int32", ())], fill=fill, name="imagenet",
                    stage_times=image.stage_times)


def make_detection(mode: str = "train", image_size: int = 320, size: str = "", max_boxes: int = 100,
                   min_scale: float = 0.3, ratio: Pair = RATIO, flip: bool = True, fast_dct: bool = False,
                   image_field: str = "image", boxes_field: str = "boxes", classes_field: str = "classes") -> Pipeline:
    """Detection: ``images uint8 [H, W, 3]``, ``boxes float32 [<=max_boxes, 4]``, ``classes int32 [<=max_boxes]``."""
    train = train_mode(mode)
    height, width = parse_size(size, image_size)
    if not 0 < min_scale <= 1:
        raise PipelineError(f"min_scale {min_scale}: must be in (0, 1]")
    if max_boxes < 1:
        raise PipelineError(f"max_boxes {max_boxes}: must be >= 1")
    ratio_range = parse_range(ratio, "ratio", 1e-3)
    clock = DecodeClock()

    def fill(record: Mapping[str, Any], rng: np.random.Generator, rows: dict[str, np.ndarray]) -> dict[str, int]:
        data = encoded_image(record, image_field)
        try:
            boxes = np.asarray(record.get(boxes_field, []), np.float32).reshape(-1, 4)
            classes = np.asarray(record.get(classes_field, []), np.int64).reshape(-1)
        except (ValueError, TypeError) as exc:
            raise SampleError(f"record fields {boxes_field!r}/{classes_field!r}: {exc}") from None
        if len(boxes) != len(classes):
            raise SampleError(f"record has {len(boxes)} boxes but {len(classes)} classes")
        t0 = time.perf_counter()
        try:
            rgb = decode_rgb(data, fast_dct)
        except DecodeError as exc:
            raise SampleError(f"record field {image_field!r}: {exc}") from None
        clock.seconds += time.perf_counter() - t0
        src_h, src_w = rgb.shape[:2]
        boxes, classes = sanitize_boxes(boxes, classes, src_h, src_w)
        if len(boxes) > max_boxes:
            raise SampleError(f"field 'boxes': the record has {len(boxes)} boxes, more than max_boxes={max_boxes}; "
                              "raise it with --pipeline-arg max_boxes=N")
        if train:
            window = window_keeping_boxes(src_h, src_w, boxes, rng, min_scale, ratio_range)
            mirrored = bool(flip and rng.random() < 0.5)
        else:
            window, mirrored = Window(0, 0, src_w, src_h), False
        resize_window(rgb, window, height, width, nearest=False, flip=mirrored, out=rows["images"])
        moved = transform_boxes(boxes, window, height, width, mirrored)
        moved, classes = sanitize_boxes(moved, classes, height, width)
        n = len(moved)
        rows["boxes"][:n], rows["boxes"][n:] = moved, 0
        rows["classes"][:n], rows["classes"][n:] = classes, 0
        return {"boxes": n, "classes": n}

    return Pipeline([Field("images", "uint8", (height, width, 3)), Field("boxes", "float32", (upto(max_boxes), 4)),
                     Field("classes", "int32", (upto(max_boxes),))], fill=fill, name="detection",
                    stage_times=clock.take)


def decode_mask(value: Any, field: str) -> np.ndarray:
    """A class-id mask from an encoded single-channel image (PNG) or a uint8 array; SampleError otherwise."""
    if isinstance(value, np.ndarray):
        mask = value
    elif isinstance(value, (bytes, bytearray, memoryview)) and len(value):
        data = bytes(value)
        try:
            read_image_info(data)  # the same pixel limit as images, before decoding
        except DecodeError as exc:
            raise SampleError(f"record field {field!r}: {exc}") from None
        mask = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED | cv2.IMREAD_IGNORE_ORIENTATION)
        if mask is None:
            raise SampleError(f"record field {field!r}: cannot decode the {len(data)} mask bytes")
    else:
        raise SampleError(f"record field {field!r} is {type(value).__name__}, expected PNG bytes or a uint8 array")
    if mask.ndim != 2 or mask.dtype != np.uint8:
        raise SampleError(f"record field {field!r}: a mask must be one uint8 channel of class ids, got "
                          f"{mask.dtype} {list(mask.shape)} (save it as an 8-bit greyscale PNG)")
    return mask


def make_segmentation(mode: str = "train", image_size: int = 256, size: str = "", scale: Pair = (0.25, 1.0),
                      ratio: Pair = RATIO, flip: bool = True, fast_dct: bool = False, image_field: str = "image",
                      mask_field: str = "mask") -> Pipeline:
    """Segmentation: ``images uint8 [H, W, 3]`` and ``masks uint8 [H, W]`` (class ids, moved with the pixels)."""
    train = train_mode(mode)
    height, width = parse_size(size, image_size)
    scale_range = parse_range(scale, "scale", 0.0, 1.0)
    ratio_range = parse_range(ratio, "ratio", 1e-3)
    clock = DecodeClock()

    def fill(record: Mapping[str, Any], rng: np.random.Generator, rows: dict[str, np.ndarray]) -> None:
        data = encoded_image(record, image_field)
        t0 = time.perf_counter()
        try:
            rgb = decode_rgb(data, fast_dct)
        except DecodeError as exc:
            raise SampleError(f"record field {image_field!r}: {exc}") from None
        mask = decode_mask(record.get(mask_field), mask_field)
        clock.seconds += time.perf_counter() - t0
        if mask.shape != rgb.shape[:2]:
            raise SampleError(f"record field {mask_field!r} is {mask.shape[1]}x{mask.shape[0]}, its image "
                              f"{rgb.shape[1]}x{rgb.shape[0]}: a mask must be the image's size")
        if train:
            y, x, h, w = random_crop_window(rgb.shape[0], rgb.shape[1], rng, scale_range, ratio_range)
            window, mirrored = Window(x, y, w, h), bool(flip and rng.random() < 0.5)
        else:
            window, mirrored = Window(0, 0, rgb.shape[1], rgb.shape[0]), False
        resize_window(rgb, window, height, width, nearest=False, flip=mirrored, out=rows["images"])
        resize_window(mask, window, height, width, nearest=True, flip=mirrored, out=rows["masks"])

    return Pipeline([Field("images", "uint8", (height, width, 3)), Field("masks", "uint8", (height, width))],
                    fill=fill, name="segmentation", stage_times=clock.take)
