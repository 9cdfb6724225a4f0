"""Random-resized-crop, flip and eval transforms into fixed-size RGB uint8 rows.

Decoding lives in ``decode`` (formats, the pixel limit, EXIF rule); this
module cuts and resizes.
train: random-resized-crop (area scale 0.08-1, aspect ratio 3/4-4/3, the
    Inception/torchvision recipe, 10 tries then a centre crop) and a random
    horizontal flip. ``decode_train_crop`` draws the window from the JPEG header
    and decodes only that window when the ``_jpeg_crop`` extension is built
    (``CROP_DECODING``), as tf.io.decode_and_crop_jpeg does; the windows are the
    same either way and the pixels differ only in the two columns at each side
    edge of the window (chroma upsampling without the neighbours outside it).
    benchmarks/decoders.py measured the choices: OpenCV, simplejpeg, PyTurboJPEG,
    reduced-DCT-scale decoding (does not pay on ImageNet-sized photos) and
    crop-window decoding (does: about a third faster).
eval: resize the short side to ``size / 0.875`` (256 for 224), centre crop.
    Deterministic.

Both transforms write into a caller-provided ``out`` slot (one row of a batch):
the resize writes there directly, so a batch is assembled with no extra copy.
Decoding errors raise DecodeError.
"""

from __future__ import annotations

import math
import warnings
from typing import Union

import cv2
import numpy as np

from stoker.producer.images.decode import MAX_PIXELS, DecodeError, decode_rgb, read_image_info

try:  # built from _jpeg_crop.c when libjpeg's headers were there at install time
    from stoker.producer.images import _jpeg_crop
except ImportError:
    _jpeg_crop = None
#: what decode_crop returns, which the code below reads: (pixels, stride, offset)
CROP_INTERFACE = 2
if _jpeg_crop is not None and getattr(_jpeg_crop, "INTERFACE", 1) != CROP_INTERFACE:  # a build of other sources
    warnings.warn(f"{_jpeg_crop.__file__} is a build of another version of Stoker's crop decoder: it is not used, "
                  "and producers decode whole images (about a quarter slower); reinstall stoker to rebuild it",
                  RuntimeWarning, stacklevel=1)
    _jpeg_crop = None
_decode_crop = _jpeg_crop.decode_crop if _jpeg_crop is not None else None

__all__ = ["CROP_DECODING", "MAX_PIXELS", "DecodeError", "decode_rgb", "decode_train_crop", "eval_transform",
           "output_hw", "random_crop_window", "resize_flip_into", "train_transform"]

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875
#: Whether JPEG crop windows are decoded on their own (the ``_jpeg_crop`` extension is built).
CROP_DECODING = _decode_crop is not None


Size = Union[int, tuple[int, int]]


def output_hw(size: Size) -> tuple[int, int]:
    """``(height, width)`` of an output size given as one int (square) or a pair."""
    if isinstance(size, (int, np.integer)):
        return int(size), int(size)
    height, width = size
    return int(height), int(width)


def decode_train_crop(data: bytes, rng: np.random.Generator, fast_dct: bool = False,
                      crop_decoding: bool = CROP_DECODING, scale: tuple[float, float] = SCALE,
                      ratio: tuple[float, float] = RATIO) -> np.ndarray:
    """RGB pixels of a random-resized-crop window of encoded image ``data``, the window drawn from ``rng``.

    With ``crop_decoding`` (and the extension built) a JPEG's window is decoded on its own;
    otherwise, or if that fails, the whole image is decoded and the window cut out. Either
    way ``rng`` is drawn from identically. DecodeError if the bytes are not an image.
    """
    info = read_image_info(data)  # DecodeError for anything unsupported or too large, before decoding
    if crop_decoding and _decode_crop is not None and info.format == "jpeg":
        y, x, h, w = random_crop_window(info.height, info.width, rng, scale, ratio)
        try:
            pixels, stride, offset = _decode_crop(data, y, x, h, w, fast_dct)
        except ValueError:  # CMYK, corrupt data: the full decoders' fallbacks and errors apply
            return decode_rgb(data, fast_dct, info)[y : y + h, x : x + w]
        # Rows widened to iMCU boundaries, decoded in place: the window is a strided view, never copied.
        rows = np.frombuffer(pixels, np.uint8, h * stride * 3).reshape(h, stride, 3)
        return rows[:, offset : offset + w]
    rgb = decode_rgb(data, fast_dct, info)
    y, x, h, w = random_crop_window(rgb.shape[0], rgb.shape[1], rng, scale, ratio)
    return rgb[y : y + h, x : x + w]


def random_crop_window(height: int, width: int, rng: np.random.Generator, scale: tuple[float, float] = SCALE,
                       ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """``(y, x, h, w)`` of a random-resized-crop window, torchvision's algorithm.

    ``scale``: range of the window's area as a fraction of the image's; ``ratio``: range of its
    width/height, drawn log-uniformly. 10 tries, then the largest centred crop within ``ratio``.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            y = int(rng.integers(0, height - h + 1))
            x = int(rng.integers(0, width - w + 1))
            return y, x, h, w
    # Fallback: the largest centred crop within the ratio bounds.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def train_transform(rgb: np.ndarray, size: Size, rng: np.random.Generator, out: np.ndarray) -> None:
    """Random-resized-crop + random flip of a decoded RGB image into ``out`` (H x W x 3, C-contiguous)."""
    y, x, h, w = random_crop_window(rgb.shape[0], rgb.shape[1], rng)
    resize_flip_into(rgb[y : y + h, x : x + w], size, rng, out)


def resize_flip_into(crop: np.ndarray, size: Size, rng: np.random.Generator, out: np.ndarray,
                     flip: bool = True) -> None:
    """Resize a crop window straight into ``out``; with ``flip``, mirror it horizontally with probability 1/2."""
    height, width = output_hw(size)
    cv2.resize(crop, (width, height), dst=_row(out, height, width), interpolation=cv2.INTER_LINEAR)
    if flip and rng.random() < 0.5:
        cv2.flip(out, 1, dst=out)


def eval_transform(rgb: np.ndarray, size: Size, out: np.ndarray, crop_fraction: float = EVAL_CROP_FRACTION) -> None:
    """Resize so the centre ``crop_fraction`` covers ``size``, then centre-crop ``size`` into ``out`` (RGB).

    Square sizes: the short side goes to ``round(size / crop_fraction)`` (256 for 224), as every ImageNet eval.
    """
    out_h, out_w = output_hw(size)
    h, w = rgb.shape[:2]
    target_h, target_w = int(round(out_h / crop_fraction)), int(round(out_w / crop_fraction))
    if target_h * w >= target_w * h:  # the height binds
        new_h, new_w = target_h, max(out_w, int(round(w * target_h / h)))
    else:
        new_h, new_w = max(out_h, int(round(h * target_w / w))), target_w
    resized = cv2.resize(rgb, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
    out[...] = resized[top : top + out_h, left : left + out_w]


def _row(out: np.ndarray, height: int, width: int) -> np.ndarray:
    # OpenCV writes into ``dst`` only when it matches exactly; otherwise it would silently allocate.
    if out.shape != (height, width, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {(height, width, 3)}, "
                         f"got {out.dtype} {out.shape}")
    return out
