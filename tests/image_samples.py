"""Real encoded images for tests: every format the producers accept, rotated ones, decompression bombs.

Bombs are small, valid files whose header is patched to claim a huge size (and, for PNG, a
fixed-up CRC), exactly what an attacker or a broken exporter would produce: a few hundred
bytes that a decoder would turn into gigabytes.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

FORMATS = ("jpeg", "png", "webp", "bmp", "gif", "tiff")
_PIL_NAMES = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF", "tiff": "TIFF"}
LOSSLESS = ("png", "bmp", "tiff")


def pattern_image(height: int = 40, width: int = 64) -> np.ndarray:
    """RGB image with no symmetry: a rotation or flip changes it, and JPEG keeps it recognisable."""
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[: height // 2, :, 0] = 220
    rgb[:, : width // 4, 1] = 200
    rgb[height // 2 :, width // 2 :, 2] = 240
    return rgb


def encode(fmt: str, rgb: np.ndarray, exif_orientation: int | None = None, mode: str = "RGB") -> bytes:
    """``rgb`` encoded as ``fmt`` by Pillow, optionally in another mode (CMYK) and with an EXIF orientation tag."""
    image = Image.fromarray(rgb).convert(mode)
    options: dict = {"lossless": True} if fmt == "webp" else {"quality": 95} if fmt == "jpeg" else {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        options["exif"] = exif.tobytes()
    buf = io.BytesIO()
    image.save(buf, _PIL_NAMES[fmt], **options)
    return buf.getvalue()


def bomb(fmt: str, side: int = 20000) -> bytes:
    """A tiny ``fmt`` file whose header claims ``side`` x ``side`` pixels (WebP: at most 16383)."""
    data = bytearray(encode(fmt, pattern_image(8, 8)))
    if fmt == "jpeg":
        sof = data.index(b"\xff\xc0")  # baseline SOF0: length(2) precision(1) height(2) width(2)
        data[sof + 5:sof + 9] = struct.pack(">HH", side, side)
    elif fmt == "png":
        data[16:24] = struct.pack(">II", side, side)  # IHDR width, height
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    elif fmt == "bmp":
        data[18:26] = struct.pack("<ii", side, side)  # BITMAPINFOHEADER width, height
    elif fmt == "gif":
        data[6:10] = struct.pack("<HH", side, side)  # logical screen
        descriptor = data.index(b"\x2c", 13)  # image descriptor: left, top, width, height
        data[descriptor + 5:descriptor + 9] = struct.pack("<HH", side, side)
    elif fmt == "tiff":
        (ifd,) = struct.unpack("<I", data[4:8])
        (entries,) = struct.unpack("<H", data[ifd:ifd + 2])
        for i in range(entries):
            entry = ifd + 2 + 12 * i
            tag, _ = struct.unpack("<HH", data[entry:entry + 4])
            if tag in (256, 257):  # ImageWidth, ImageLength as one LONG
                data[entry + 2:entry + 12] = struct.pack("<HII", 4, 1, side)
    elif fmt == "webp":
        side = min(side, 16383)  # VP8L: 14 bits each, stored minus one
        start = data.index(b"VP8L") + 8 + 1  # chunk header, then the 0x2f signature
        bits = (side - 1) | ((side - 1) << 14) | (int.from_bytes(data[start:start + 4], "little") & ~((1 << 28) - 1))
        data[start:start + 4] = bits.to_bytes(4, "little")
    else:
        raise ValueError(fmt)
    return bytes(data)


def real_png_bomb(side: int = 10000) -> bytes:
    """A genuine, fully valid ``side`` x ``side`` black PNG (300 MB of pixels at 10000) in well under 1 MB.

    Streamed through zlib row by row, so making it never holds the image in memory.
    """
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    compressor = zlib.compressobj(9)
    row = bytes(1 + 3 * side)  # filter byte 0, then black RGB pixels
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
