"""Encoded image bytes to RGB uint8 pixels: one rule for every format and every decoder.

Formats are recognised by their first bytes, never by file name: JPEG, PNG, WebP,
BMP, GIF (first frame) and TIFF (first page). Anything else raises DecodeError
saying so, which the builder lists and the producer counts.

Decompression bombs: the size is read from the header (simplejpeg for JPEG,
Pillow's format plugin for the rest, neither decodes) before any decoder
allocates, and an image of more than ``MAX_PIXELS`` is refused. ``stoker lmdb
build`` uses the same limit, so such an image never enters a dataset; a producer
that meets one anyway (an LMDB written otherwise) skips and counts it.

EXIF orientation is ignored on every path: pixels come out as stored, as from
``tf.io.decode_jpeg``, libjpeg and simplejpeg. OpenCV would apply it, so it is
called with ``IMREAD_IGNORE_ORIENTATION``. For TIFF, whose orientation tag is part
of the format, OpenCV (and Pillow) apply it whatever the flags, so the TIFF
decoder undoes it: the stored raster comes out, as for every other format.

Decoders: JPEG: simplejpeg (libjpeg-turbo), OpenCV for what it refuses; PNG,
WebP, BMP, GIF, TIFF: OpenCV. A decoded size that differs from the header's
raises DecodeError.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable, Optional

import cv2
import numpy as np
import simplejpeg
from PIL import BmpImagePlugin, GifImagePlugin, Image, JpegImagePlugin, PngImagePlugin, TiffImagePlugin, WebPImagePlugin

#: Largest image decoded (8192 x 8192 pixels, 192 MiB as RGB). Larger ones are refused from their header.
MAX_PIXELS = 2**26
FORMATS = ("jpeg", "png", "webp", "bmp", "gif", "tiff")
SUPPORTED = "JPEG, PNG, WebP, BMP, GIF or TIFF"
_OPENCV_FLAGS = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
_PILLOW_PLUGINS = {
    "jpeg": JpegImagePlugin.JpegImageFile, "png": PngImagePlugin.PngImageFile, "webp": WebPImagePlugin.WebPImageFile,
    "bmp": BmpImagePlugin.BmpImageFile, "gif": GifImagePlugin.GifImageFile, "tiff": TiffImagePlugin.TiffImageFile,
}


class DecodeError(ValueError):
    """The bytes are not an image Stoker decodes, or too large to decode; the message says which."""


@dataclass(frozen=True)
class ImageInfo:
    """What an image's header says, read without decoding."""

    format: str
    height: int
    width: int
    orientation: int = 1  # TIFF orientation tag (1-8); 1 for every other format

    @property
    def pixels(self) -> int:
        return self.height * self.width


def sniff_format(data: bytes) -> Optional[str]:
    """The format named by the first bytes (one of FORMATS), or None."""
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:2] == b"BM":
        return "bmp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    return None


def read_image_info(data: bytes) -> ImageInfo:
    """Format and size from the header, without decoding; DecodeError if unsupported, unreadable or too large."""
    fmt = sniff_format(data)
    if fmt is None:
        raise DecodeError(f"the {len(data)} image bytes are not a {SUPPORTED} image")
    info = None
    if fmt == "jpeg":
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            info = ImageInfo(fmt, height, width)
        except ValueError:
            pass  # e.g. a JPEG libjpeg-turbo will not take; Pillow's parser may still read its size
    if info is None:
        try:
            with _PILLOW_PLUGINS[fmt](io.BytesIO(data)) as image:
                if fmt == "tiff":  # the stored raster's size; Pillow's .size is after orientation
                    tags = image.tag_v2
                    info = ImageInfo(fmt, int(tags[257]), int(tags[256]), int(tags.get(274, 1)))
                else:
                    info = ImageInfo(fmt, image.height, image.width)
        except Image.DecompressionBombError as exc:  # some plugins (WebP) check before we can
            raise DecodeError(f"{fmt.upper()} is too large ({exc}), more than the {MAX_PIXELS} (8192x8192) pixels "
                              "Stoker decodes; resize it") from None
        except Exception as exc:  # Pillow raises several types for a bad header
            raise DecodeError(f"cannot read a {fmt.upper()} header from the {len(data)} image bytes ({exc})") from None
    if info.height <= 0 or info.width <= 0:
        raise DecodeError(f"{fmt.upper()} header says {info.width}x{info.height} pixels")
    if info.pixels > MAX_PIXELS:
        raise DecodeError(f"{fmt.upper()} is {info.width}x{info.height} pixels, more than the {MAX_PIXELS} "
                          "(8192x8192) pixels Stoker decodes; resize it")
    return info


def decode_with_simplejpeg(data: bytes, fast_dct: bool = False) -> np.ndarray:
    """JPEG via libjpeg-turbo, RGB out; ValueError if it refuses the file."""
    return simplejpeg.decode_jpeg(data, "RGB", fastdct=fast_dct, fastupsample=fast_dct)


def decode_with_opencv(data: bytes, fast_dct: bool = False) -> np.ndarray:
    """Any format OpenCV reads, EXIF orientation ignored, RGB out; ValueError if it cannot."""
    try:
        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), _OPENCV_FLAGS)
    except cv2.error as exc:  # e.g. an empty buffer
        raise ValueError(f"OpenCV: {exc}") from None
    if bgr is None or bgr.ndim != 3 or bgr.size == 0:
        raise ValueError("OpenCV cannot decode it")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


# Stored raster from an image displayed per TIFF orientation 1-8 (the inverse of each tag's transform).
_UNDO_ORIENTATION: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    1: lambda a: a, 2: np.fliplr, 3: lambda a: np.rot90(a, 2), 4: np.flipud, 5: lambda a: np.swapaxes(a, 0, 1),
    6: lambda a: np.rot90(a, 1), 7: lambda a: np.rot90(np.swapaxes(a, 0, 1), 2), 8: lambda a: np.rot90(a, -1),
}


def decode_tiff_as_stored(data: bytes, fast_dct: bool = False) -> np.ndarray:
    """TIFF (first page) via OpenCV, its orientation tag undone, RGB out; ValueError if it cannot."""
    try:
        with TiffImagePlugin.TiffImageFile(io.BytesIO(data)) as image:
            orientation = int(image.tag_v2.get(274, 1))
    except Exception as exc:
        raise ValueError(f"Pillow cannot read the TIFF tags: {exc}") from None
    undo = _UNDO_ORIENTATION.get(orientation, _UNDO_ORIENTATION[1])
    return np.ascontiguousarray(undo(decode_with_opencv(data)))


#: The decoders tried for each format, in order.
DECODERS: dict[str, tuple[Callable[[bytes, bool], np.ndarray], ...]] = {
    "jpeg": (decode_with_simplejpeg, decode_with_opencv),
    "png": (decode_with_opencv,), "webp": (decode_with_opencv,), "bmp": (decode_with_opencv,),
    "gif": (decode_with_opencv,), "tiff": (decode_tiff_as_stored,),
}


def decode_rgb(data: bytes, fast_dct: bool = False, info: Optional[ImageInfo] = None) -> np.ndarray:
    """Decode to RGB uint8 ``[H, W, 3]`` as stored (EXIF ignored); DecodeError if not possible (see module doc).

    ``fast_dct`` uses libjpeg-turbo's fast integer IDCT and upsampling for JPEGs.
    ``info`` (from read_image_info) saves reading the header twice.
    """
    info = info or read_image_info(data)
    errors = []
    for decoder in DECODERS[info.format]:
        try:
            rgb = decoder(data, fast_dct)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if rgb.shape[:2] != (info.height, info.width):
            raise DecodeError(f"decoded {info.format.upper()} is {rgb.shape[1]}x{rgb.shape[0]} pixels, its header "
                              f"says {info.width}x{info.height}")
        return rgb
    raise DecodeError(f"cannot decode the {len(data)} image bytes as {info.format.upper()} ({'; '.join(errors)})")


def check_encoded_image(data: bytes) -> Optional[str]:
    """None if a producer can decode ``data``, else the reason it cannot (the builders' check).

    Same rules as decoding (format by content, pixel limit from the header), plus: a JPEG must end
    with its end-of-image marker (a truncated file often decodes to a half-grey image).
    """
    if sniff_format(data) == "jpeg" and bytes(data).rfind(b"\xff\xd9") < 0:
        return "truncated JPEG (no end-of-image marker)"
    try:
        decode_rgb(data, info=read_image_info(data))
    except DecodeError as exc:
        return str(exc)
    return None
