"""A user pipeline for the tests (--pipeline tests/pipelines/shifted_labels.py:make_pipeline): a resized image and
the record's label plus ``shift``, so its labels reach beyond the classes its dataset names."""

import cv2
import numpy as np

from stoker.producer.images.decode import decode_rgb
from stoker.producer.pipeline import Field, Pipeline


def make_pipeline(size: int = 32, shift: int = 0) -> Pipeline:
    def sample(record, rng):
        return {"images": cv2.resize(decode_rgb(record["image"]), (size, size)),
                "labels": np.int32(record["label"] + shift)}

    return Pipeline([Field("images", "uint8", (size, size, 3)), Field("labels", "int32")], sample=sample)
