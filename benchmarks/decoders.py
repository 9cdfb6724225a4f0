#!/usr/bin/env python3
"""Which JPEG decoder, and can reduced-DCT decoding push past the decoder limit? One thread, one run.

The reference job's per-image work (decode, random-resized-crop to 224, flip, RGB into
the batch row) timed for each decoder that installs from the registry:

- OpenCV ``imdecode`` (BGR out, so a channel swap into the row), with numpy's
  negative-stride flip and swap (the producer before) and with OpenCV's;
- simplejpeg (libjpeg-turbo, RGB out, so the resize writes straight into the row),
  exact and with ``--fast-dct`` (``fastdct``/``fastupsample``);
- PyTurboJPEG 1.x (libjpeg-turbo via the system's ``libturbojpeg0``), if importable;
- crop-window decoding (``stoker.producer.images._jpeg_crop``: libjpeg decodes only the
  window, as tf.io.decode_and_crop_jpeg does): the producer, when it is built.

Then the ceiling of reduced-DCT decoding: decode-only speed at scale 1, 7/8, 3/4, 5/8,
1/2, 1/4 (libjpeg-turbo's scaled IDCT), and on what share of the reference job's crops
each scale could be used without upsampling more than a full decode would
(crop side x scale >= 224). The table answers whether decoding at reduced scale
pays on this data.

Run:  python benchmarks/decoders.py [--seconds 4]   (table + JSON)
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import cv2
import numpy as np
import simplejpeg

from harness import add_out_argument, benchmark_parser, write_results
from stoker.producer.images.augment import (
    CROP_DECODING,
    decode_rgb,
    decode_train_crop,
    random_crop_window,
    resize_flip_into,
    train_transform,
)
from stoker.producer.dataset.build.synthetic import synthetic_jpeg

SIZE = 224
SCALES = [(1, 1), (7, 8), (3, 4), (5, 8), (1, 2), (1, 4)]


def optional(module: str) -> Optional[object]:
    try:
        return __import__(module)
    except Exception:  # not installed, or its shared library is missing or too old
        return None


def rate(fn: Callable[[bytes, np.random.Generator], None], records: list[bytes], seconds: float) -> float:
    rng = np.random.default_rng(0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(records[n % len(records)], rng)
        n += 1
    return n / (time.perf_counter() - t0)


def opencv_bgr(data: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)


def numpy_swap_transform(bgr: np.ndarray, rng: np.random.Generator, out: np.ndarray) -> None:
    """The producer's train transform before: OpenCV BGR decode, numpy flip and channel swap."""
    y, x, h, w = random_crop_window(bgr.shape[0], bgr.shape[1], rng)
    resized = cv2.resize(bgr[y : y + h, x : x + w], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        resized = resized[:, ::-1]
    out[...] = resized[:, :, ::-1]


def opencv_swap_transform(bgr: np.ndarray, rng: np.random.Generator, out: np.ndarray) -> None:
    """Same output, flip and channel swap done by OpenCV into the row."""
    y, x, h, w = random_crop_window(bgr.shape[0], bgr.shape[1], rng)
    resized = cv2.resize(bgr[y : y + h, x : x + w], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        cv2.flip(resized, 1, dst=resized)
    cv2.cvtColor(resized, cv2.COLOR_BGR2RGB, dst=out)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=200, help="synthetic JPEGs (~92 KB, 300-500 px)")
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    add_out_argument(parser, "decoders.json")
    args = parser.parse_args()
    cv2.setNumThreads(1)
    records = [synthetic_jpeg(0, i, 10)[0] for i in range(args.records)]
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    turbojpeg = optional("turbojpeg")
    tj = turbojpeg.TurboJPEG() if turbojpeg is not None else None  # type: ignore[attr-defined]

    before = "opencv BGR, numpy flip+swap (before)"
    pipelines: dict[str, Callable[[bytes, np.random.Generator], None]] = {
        before: lambda d, r: numpy_swap_transform(opencv_bgr(d), r, out),
        "opencv BGR, cv2 flip+swap into row": lambda d, r: opencv_swap_transform(opencv_bgr(d), r, out),
        "simplejpeg RGB, resize into row": lambda d, r: train_transform(decode_rgb(d), SIZE, r, out),
        "simplejpeg RGB --fast-dct": lambda d, r: train_transform(decode_rgb(d, fast_dct=True), SIZE, r, out),
    }
    if CROP_DECODING:
        pipelines["crop-window decode (producer)"] = lambda d, r: resize_flip_into(decode_train_crop(d, r), SIZE, r, out)
        pipelines["crop-window decode (producer --fast-dct)"] = lambda d, r: resize_flip_into(
            decode_train_crop(d, r, fast_dct=True), SIZE, r, out)
    if tj is not None:
        pipelines["pyturbojpeg RGB, resize into row"] = lambda d, r: train_transform(
            tj.decode(d, pixel_format=turbojpeg.TJPF_RGB), SIZE, r, out)
    pipeline_rates = {name: rate(fn, records, args.seconds) for name, fn in pipelines.items()}
    # The baseline again, last: drift (thermal, neighbours) shows as a difference between the two.
    pipeline_rates[before + ", again"] = rate(pipelines[before], records, args.seconds)

    decode_rates: dict[str, float] = {}
    if tj is not None:
        for num, den in SCALES:
            decode_rates[f"{num}/{den}"] = rate(
                lambda d, r, f=(num, den): tj.decode(d, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=f),
                records, args.seconds / 2)
    decode_rates["opencv 1/1"] = rate(lambda d, r: opencv_bgr(d), records, args.seconds / 2)
    decode_rates["opencv 1/2 (IMREAD_REDUCED_COLOR_2)"] = rate(
        lambda d, r: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_REDUCED_COLOR_2), records, args.seconds / 2)

    # Share of the reference job's crops that each scale could serve without extra upsampling.
    rng = np.random.default_rng(1)
    shapes = [opencv_bgr(d).shape[:2] for d in records]
    sides = [min(random_crop_window(h, w, rng)[2:]) for h, w in shapes for _ in range(50)]
    # A full decode serves every crop (small ones are upsampled whatever the decoder does).
    usable = {f"{n}/{d}": 1.0 if n == d else float(np.mean([side * n / d >= SIZE for side in sides]))
              for n, d in SCALES}

    base = pipeline_rates[before]
    print(f"decode + random-resized-crop {SIZE} + flip into the batch row, one thread, "
          f"{np.mean([len(r) for r in records]) / 1e3:.0f} KB JPEGs:")
    print(f"{'pipeline':<46} | {'images/s':>8} | {'vs before':>9}")
    print("-" * 66)
    for name, value in pipeline_rates.items():
        print(f"{name:<46} | {value:>8.0f} | {value / base:>9.3f}")
    if not CROP_DECODING:
        print("not measured: crop-window decoding (stoker.producer.images._jpeg_crop not built: install libjpeg headers)")
    if tj is None:
        print("not measured: PyTurboJPEG (pip install 'pyturbojpeg<2'; apt-get install libturbojpeg0)")
    full = decode_rates.get("1/1", decode_rates["opencv 1/1"])
    print("\ndecode only, by DCT scale (libjpeg-turbo), and the share of crops each could serve:")
    print(f"{'scale':<36} | {'images/s':>8} | {'vs 1/1':>6} | {'crops':>6}")
    print("-" * 66)
    for name, value in decode_rates.items():
        share = usable.get(name)
        print(f"{name:<36} | {value:>8.0f} | {value / full:>6.2f} | {'' if share is None else f'{share:6.1%}'}")
    result = {"benchmark": "decoders", "pipelines_images_per_s": pipeline_rates,
              "decode_only_images_per_s": decode_rates, "crop_share_servable_by_scale": usable,
              "mean_jpeg_bytes": float(np.mean([len(r) for r in records])), "opencv": cv2.__version__,
              "simplejpeg": simplejpeg.__version__, "pyturbojpeg": tj is not None,
              "crop_decoding": CROP_DECODING}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
