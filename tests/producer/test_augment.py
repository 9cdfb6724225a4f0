"""The producer's decode and augmentation against references written out independently."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest

from pathlib import Path

from stoker.producer.images.augment import (
    CROP_DECODING,
    DecodeError,
    decode_rgb,
    decode_train_crop,
    random_crop_window,
    train_transform,
)
from stoker.producer.dataset.build.synthetic import synthetic_jpeg

SIZE = 64


def reference_window(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (scale 0.08-1, ratio 3/4-4/3), drawing from ``rng``."""
    area = height * width
    for _ in range(10):
        target_area = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        h, w = height, int(round(height * 4 / 3))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def reference_train_image(data: bytes, rng: np.random.Generator) -> np.ndarray:
    """Decode with OpenCV, crop, resize, flip, BGR->RGB: the plain way, with numpy."""
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    y, x, h, w = reference_window(*bgr.shape[:2], rng)
    resized = cv2.resize(bgr[y:y + h, x:x + w], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        resized = resized[:, ::-1]
    return np.ascontiguousarray(resized[:, :, ::-1])


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return [synthetic_jpeg(5, i, 4)[0] for i in range(12)]


def test_train_transform_gives_the_reference_crops_and_pixels_exactly(jpegs):
    batch = np.zeros((len(jpegs) * 20, SIZE, SIZE, 3), np.uint8)
    row = 0
    for i, data in enumerate(jpegs):
        for seed in range(20):
            train_transform(decode_rgb(data), SIZE, np.random.default_rng([i, seed]), batch[row])
            expected = reference_train_image(data, np.random.default_rng([i, seed]))
            np.testing.assert_array_equal(batch[row], expected, err_msg=f"image {i}, seed {seed}")
            row += 1


@pytest.mark.parametrize("height, width", [(375, 500), (500, 300), (224, 224)])
def test_crop_windows_follow_the_reference_distribution(height, width):
    """Two independent streams, ours and the reference sampler: same bounds, same deciles."""
    ours = np.array([random_crop_window(height, width, np.random.default_rng([0, i])) for i in range(20000)])
    ref = np.array([reference_window(height, width, np.random.default_rng([1, i])) for i in range(20000)])
    for windows in (ours, ref):
        assert (windows[:, :2] >= 0).all()
        assert (windows[:, 0] + windows[:, 2] <= height).all() and (windows[:, 1] + windows[:, 3] <= width).all()
    deciles = np.linspace(0.1, 0.9, 9)

    def stats(w: np.ndarray) -> dict[str, np.ndarray]:
        return {"area": w[:, 2] * w[:, 3] / (height * width), "log_aspect": np.log(w[:, 3] / w[:, 2]),
                "centre_y": (w[:, 0] + w[:, 2] / 2) / height, "centre_x": (w[:, 1] + w[:, 3] / 2) / width}

    for name, (a, b) in {k: (v, stats(ref)[k]) for k, v in stats(ours).items()}.items():
        gap = np.abs(np.quantile(a, deciles) - np.quantile(b, deciles)).max()
        assert gap < 0.02, f"{name} deciles differ by {gap:.3f} from the reference sampler"
    area = stats(ours)["area"]
    assert area.min() >= 0.079 and area.max() <= 1.0


def test_png_and_grayscale_jpeg_decode_to_rgb():
    gray = np.tile(np.arange(32, dtype=np.uint8) * 8, (16, 1))
    for ext in (".png", ".jpg"):
        ok, encoded = cv2.imencode(ext, gray)
        assert ok
        rgb = decode_rgb(encoded.tobytes())
        assert rgb.shape == (16, 32, 3) and rgb.dtype == np.uint8
        assert np.abs(rgb[..., 0].astype(int) - gray).max() <= 2


def test_cmyk_jpeg_falls_back_to_opencv():
    # A four-component (CMYK/Adobe) JPEG: libjpeg-turbo refuses CMYK -> RGB, OpenCV converts it.
    pil = pytest.importorskip("PIL.Image")
    import io

    buf = io.BytesIO()
    pil.new("CMYK", (24, 16), (0, 255, 255, 0)).save(buf, format="JPEG")
    rgb = decode_rgb(buf.getvalue())
    assert rgb.shape == (16, 24, 3)


@pytest.mark.parametrize("data", [b"", b"\xff\xd8 truncated jpeg", b"not an image at all", b"\x89PNG\r\n\x1a\n"])
def test_garbage_raises_decode_error_naming_the_byte_count(data):
    with pytest.raises(DecodeError, match=f"{len(data)} image bytes"):
        decode_rgb(data)


def test_fast_dct_is_close_to_the_exact_decode_but_not_identical(jpegs):
    diffs = [np.abs(decode_rgb(d, fast_dct=True).astype(int) - decode_rgb(d).astype(int)).mean() for d in jpegs]
    assert 0.1 < np.mean(diffs) < 6.0


def test_oversized_jpeg_is_refused_from_its_header_before_decoding():
    ok, encoded = cv2.imencode(".jpg", np.zeros((64, 64, 3), np.uint8))
    data = bytearray(encoded.tobytes())
    sof = data.index(b"\xff\xc0")  # baseline SOF0: length(2) precision(1) height(2) width(2)
    data[sof + 5:sof + 9] = (30000).to_bytes(2, "big") * 2
    with pytest.raises(DecodeError, match="30000x30000 pixels"):
        decode_rgb(bytes(data))


needs_crop_decoder = pytest.mark.skipif(not CROP_DECODING, reason="stoker.producer.images._jpeg_crop not built (no libjpeg headers)")


def test_crop_decoder_is_built_wherever_libjpeg_headers_are():
    if Path("/usr/include/jpeglib.h").exists():
        assert CROP_DECODING, ("libjpeg headers are here but the _jpeg_crop extension was not built: install a C "
                               "compiler and Python's headers (Debian: gcc python3-dev), then reinstall stoker")


@needs_crop_decoder
def test_crop_decoding_gives_the_same_windows_and_nearly_the_same_pixels(jpegs):
    for i, data in enumerate(jpegs):
        for seed in range(20):
            fast_rng, full_rng = np.random.default_rng([i, seed]), np.random.default_rng([i, seed])
            cropped = decode_train_crop(data, fast_rng, crop_decoding=True)
            whole = decode_train_crop(data, full_rng, crop_decoding=False)
            assert cropped.shape == whole.shape, f"image {i}, seed {seed}: windows differ"
            assert fast_rng.random() == full_rng.random(), "the two paths drew differently from the rng"
            diff = np.abs(cropped.astype(int) - whole.astype(int))
            # Only chroma upsampling at the window's left and right edges can differ (libjpeg decodes
            # whole MCU columns and upsamples chroma without the neighbours outside them).
            assert diff.mean() < 0.1 and (diff[:, 2:-2] == 0).all(), f"image {i}, seed {seed}: {diff.mean():.3f}"


@needs_crop_decoder
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("subsampling", [cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444,
                                         "gray"])
def test_crop_decoder_writes_widened_rows_in_place_and_the_window_is_a_view(subsampling, fast):
    """The extension's contract (interface 2): rows ``stride`` pixels wide (the window widened to iMCU boundaries,
    by less than 32 pixels), the window ``offset`` pixels in; decode_train_crop hands out a view of those rows."""
    from stoker.producer.images import _jpeg_crop
    from stoker.producer.images.augment import CROP_INTERFACE, random_crop_window

    assert _jpeg_crop.INTERFACE == CROP_INTERFACE
    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, (96, 120, 3), np.uint8)
    if subsampling == "gray":
        ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2GRAY))
    else:
        ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, subsampling])
    assert ok
    data = encoded.tobytes()
    whole = decode_rgb(data, fast)
    for y, x, h, w in [(0, 0, 96, 120), (5, 3, 40, 17), (17, 41, 60, 79), (95, 119, 1, 1), (0, 63, 96, 1)]:
        pixels, stride, offset = _jpeg_crop.decode_crop(data, y, x, h, w, fast)
        assert w <= stride - offset and stride < w + 32 and offset < 32, (y, x, h, w, stride, offset)
        assert len(pixels) >= h * stride * 3
        window = np.frombuffer(pixels, np.uint8, h * stride * 3).reshape(h, stride, 3)[:, offset : offset + w]
        diff = np.abs(window.astype(int) - whole[y : y + h, x : x + w].astype(int))
        assert (diff[:, 2:-2] == 0).all() and diff.mean() < 8, (y, x, h, w)
    y, x, h, w = random_crop_window(96, 120, np.random.default_rng(0))
    _, stride, _ = _jpeg_crop.decode_crop(data, y, x, h, w, fast)
    crop = decode_train_crop(data, np.random.default_rng(0), fast_dct=fast, crop_decoding=True)
    assert crop.shape == (h, w, 3) and crop.strides == (stride * 3, 3, 1)  # a view of the decoded rows, no copy


@needs_crop_decoder
@pytest.mark.parametrize("data", [b"\xff\xd8 truncated jpeg", b"\xff\xd8\xff\xc0" + bytes(30)])
def test_crop_decoding_of_garbage_raises_decode_error(data):
    with pytest.raises(DecodeError):
        decode_train_crop(data, np.random.default_rng(0), crop_decoding=True)


@needs_crop_decoder
def test_crop_decoding_falls_back_for_cmyk_and_refuses_bombs():
    pil = pytest.importorskip("PIL.Image")
    import io

    buf = io.BytesIO()
    pil.new("CMYK", (48, 32), (0, 255, 255, 0)).save(buf, format="JPEG")
    crop = decode_train_crop(buf.getvalue(), np.random.default_rng(0), crop_decoding=True)
    assert crop.ndim == 3 and crop.shape[2] == 3 and crop.shape[0] <= 32 and crop.shape[1] <= 48
    ok, encoded = cv2.imencode(".jpg", np.zeros((64, 64, 3), np.uint8))
    data = bytearray(encoded.tobytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = (30000).to_bytes(2, "big") * 2
    with pytest.raises(DecodeError, match="30000x30000"):
        decode_train_crop(bytes(data), np.random.default_rng(0), crop_decoding=True)
