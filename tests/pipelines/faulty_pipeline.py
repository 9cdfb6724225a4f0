"""A user pipeline for the tests, loaded with --pipeline tests/pipelines/faulty_pipeline.py:make_pipeline.

It makes plain samples (a resized image, its label, up to 4 boxes) and misbehaves on the
records whose ``id`` field is named in ``faults`` ("kind@index,..."): raise, wrong dtype, wrong shape, too many boxes,
or ``die``: the worker process is killed by SIGSEGV, as a crashing native decoder would kill it.
"""

import os
import signal

import cv2
import numpy as np

from stoker.producer.images.decode import decode_rgb
from stoker.producer.pipeline import Field, Pipeline, upto


def make_pipeline(size: int = 32, faults: str = "") -> Pipeline:
    planned = {}
    for item in filter(None, faults.split(",")):
        kind, _, index = item.partition("@")
        planned[int(index)] = kind

    def sample(record, rng):
        image = cv2.resize(decode_rgb(record["image"]), (size, size))
        if rng.random() < 0.5:
            image = image[:, ::-1]
        boxes = np.tile(np.array([[0, 0, size / 2, size / 2]], np.float32), (record["label"] % 3 + 1, 1))
        fault = planned.get(record["id"])
        sample = {"images": image, "labels": record["label"], "boxes": boxes}
        if fault == "die":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "raise":
            raise RuntimeError("user bug on purpose")
        if fault == "dtype":
            sample["images"] = image.astype(np.float32)
        if fault == "shape":
            sample["images"] = image[:, : size // 2]
        if fault == "boxes":
            sample["boxes"] = np.zeros((5, 4), np.float32)
        return sample

    return Pipeline([Field("images", "uint8", (size, size, 3)), Field("labels", "int32"),
                     Field("boxes", "float32", (upto(4), 4))], sample=sample)
