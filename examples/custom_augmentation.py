"""Your own augmentation, run in Stoker's producer workers: colour jitter and random erasing.

``make_pipeline`` is all a user writes: declared fields plus a per-sample function of a
record and an rng (use only that rng: runs with --seed are then reproducible). On data
hosts the same function runs with:

    stoker produce --lmdb train.lmdb --pipeline examples/custom_augmentation.py:make_pipeline \
                   --pipeline-arg size=96 --workers 16

Run this file to see it end to end on this machine: a synthetic dataset, two producers
on loopback, and a small CNN trained on what they send.
"""

import argparse
import tempfile
from pathlib import Path

import cv2
import numpy as np

from stoker.producer.images.decode import decode_rgb
from stoker.producer.pipeline import Field, Pipeline


def make_pipeline(size: int = 64, jitter: float = 0.3, erase: float = 0.5) -> Pipeline:
    def sample(record, rng):
        image = cv2.resize(decode_rgb(record["image"]), (size, size), interpolation=cv2.INTER_AREA)
        image = image.astype(np.float32) * rng.uniform(1 - jitter, 1 + jitter, size=3)  # per-channel colour jitter
        if rng.random() < erase:  # random erasing: a box of noise over up to a quarter of the image
            h, w = rng.integers(size // 8, size // 2, size=2)
            y, x = rng.integers(0, size - h), rng.integers(0, size - w)
            image[y:y + h, x:x + w] = rng.uniform(0, 255, size=(h, w, 3))
        if rng.random() < 0.5:
            image = image[:, ::-1]
        return {"images": np.clip(image, 0, 255).astype(np.uint8), "labels": record["label"]}

    return Pipeline([Field("images", "uint8", (size, size, 3)), Field("labels", "int32")], sample=sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--records", type=int, default=256, help="synthetic images")
    args = parser.parse_args()

    import tensorflow as tf

    from stoker.consumer import ZMQInput
    from stoker.producer.process import ProducerProcess
    from stoker.producer.dataset.build.synthetic import build_synthetic

    scratch = tempfile.TemporaryDirectory(prefix="stoker-example-")  # removed at exit
    data = Path(scratch.name) / "train"
    build_synthetic(data, args.records, num_classes=4, progress=False)
    common = ["--workers", "1", "--batch-size", "16", "--pipeline", f"{__file__}:make_pipeline"]
    with ProducerProcess(data, extra_args=[*common, "--shard", "0/2"]) as a, \
            ProducerProcess(data, extra_args=[*common, "--shard", "1/2"]) as b, \
            ZMQInput([a.endpoint, b.endpoint]) as inp:  # learns the batch spec from the first batch
        model = tf.keras.Sequential([tf.keras.Input((64, 64, 3), dtype="uint8"), tf.keras.layers.Rescaling(1 / 255),
                                     tf.keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
                                     tf.keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
                                     tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(4)])
        model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        history = model.fit(inp.as_dataset(), steps_per_epoch=args.steps, epochs=1, verbose=2,
                            callbacks=[inp.keras_callback(log_every=50)])
    print(f"final loss {history.history['loss'][-1]:.3f}, accuracy {history.history['accuracy'][-1]:.2f}")


if __name__ == "__main__":
    main()
