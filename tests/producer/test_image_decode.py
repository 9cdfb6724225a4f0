"""Decoding rules shared by the builder and the producers: formats by content, bombs refused, EXIF ignored."""

from __future__ import annotations

import numpy as np
import pytest

from image_samples import FORMATS, LOSSLESS, bomb, encode, pattern_image
from stoker.producer.images.augment import CROP_DECODING, decode_train_crop
from stoker.producer.images.decode import (DECODERS, DecodeError, decode_rgb, decode_with_opencv, read_image_info,
                                          sniff_format)
from stoker.producer.dataset.build.builder import check_encoded_image

TOO_LARGE = "pixels Stoker decodes"


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_accepted_format_is_recognised_by_content_and_decodes_to_the_stored_pixels(fmt):
    rgb = pattern_image()
    data = encode(fmt, rgb)
    assert sniff_format(data) == fmt
    info = read_image_info(data)
    assert (info.format, info.height, info.width) == (fmt, 40, 64)
    decoded = decode_rgb(data)
    assert decoded.shape == (40, 64, 3) and decoded.dtype == np.uint8
    tolerance = 0 if fmt in LOSSLESS + ("webp",) else 12 if fmt == "jpeg" else 40  # GIF: a 256-colour palette
    assert np.abs(decoded.astype(int) - rgb).mean() <= tolerance
    assert check_encoded_image(data) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_decompression_bomb_is_refused_from_its_header_on_every_path(fmt):
    data = bomb(fmt)
    assert len(data) < 2000  # a few hundred bytes that claim gigabytes of pixels
    with pytest.raises(DecodeError, match=TOO_LARGE):
        read_image_info(data)
    with pytest.raises(DecodeError, match=TOO_LARGE):
        decode_rgb(data)
    for crop_decoding in {False, CROP_DECODING}:
        with pytest.raises(DecodeError, match=TOO_LARGE):
            decode_train_crop(data, np.random.default_rng(0), crop_decoding=crop_decoding)
    assert TOO_LARGE in check_encoded_image(data)


ROTATED = [  # (format, Pillow mode): every decoder path, each with EXIF orientation 6 (rotate 90 on display)
    ("jpeg", "RGB"), ("jpeg", "CMYK"), ("png", "RGB"), ("webp", "RGB"), ("tiff", "RGB"),
]


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt, mode", ROTATED, ids=[f"{f}-{m}" for f, m in ROTATED])
def test_exif_orientation_is_ignored_by_every_decoder(fmt, mode, orientation):
    """One rule, as tf.io.decode_jpeg: pixels as stored. OpenCV and Pillow would rotate or flip these."""
    rgb = pattern_image()
    data = encode(fmt, rgb, exif_orientation=orientation, mode=mode)
    tolerance = 14 if fmt == "jpeg" else 0
    decoders = {d.__name__: d for d in DECODERS[fmt]}
    decoders["decode_with_opencv"] = decode_with_opencv  # the fallback any JPEG may take
    if fmt == "tiff":
        decoders.pop("decode_with_opencv")  # OpenCV rotates TIFFs whatever the flags: not used for them
    for name, decoder in decoders.items():
        pixels = decoder(data, False)
        assert pixels.shape == (40, 64, 3), f"{name} rotated a {fmt} {mode} image"
        if fmt != "jpeg":
            assert np.array_equal(pixels, rgb), f"{name} flipped or rotated a {fmt} image"
        assert np.abs(pixels.astype(int) - rgb).mean() <= tolerance, name
    assert decode_rgb(data).shape == (40, 64, 3)
    assert read_image_info(data).height == 40
    crop = decode_train_crop(data, np.random.default_rng(0), crop_decoding=CROP_DECODING)
    assert crop.shape[0] <= 40 and crop.shape[1] <= 64


def test_what_is_not_an_accepted_image_is_named():
    assert "not a JPEG, PNG, WebP, BMP, GIF or TIFF image" in check_encoded_image(b"just some text\n")
    truncated = encode("jpeg", pattern_image())[:300]
    assert check_encoded_image(truncated) == "truncated JPEG (no end-of-image marker)"
    with pytest.raises(DecodeError, match="cannot read a PNG header from the 8 image bytes"):
        read_image_info(b"\x89PNG\r\n\x1a\n")
