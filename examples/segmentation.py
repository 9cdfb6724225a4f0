"""Segmentation: images and masks through one crop, resize and flip, a tiny network trained per pixel.

The built-in ``segmentation`` pipeline decodes each record's image and its PNG mask of
class ids, cuts the same random window from both, resizes the image bilinearly and the
mask by nearest neighbour (class ids stay class ids) and flips both together. Batches
carry ``images`` uint8 [B, H, W, 3] and ``masks`` uint8 [B, H, W].
"""

import argparse
import tempfile
from pathlib import Path

SIZE, CLASSES = 64, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument("--records", type=int, default=96, help="synthetic images")
    args = parser.parse_args()

    import tensorflow as tf

    from stoker.consumer import ZMQInput
    from stoker.producer.process import ProducerProcess
    from stoker.producer.dataset.build.synthetic import build_synthetic

    scratch = tempfile.TemporaryDirectory(prefix="stoker-example-")  # removed at exit
    data = Path(scratch.name) / "masks"
    build_synthetic(data, args.records, num_classes=CLASSES, task="segmentation", progress=False)
    args_ = ["--workers", "2", "--batch-size", "8", "--pipeline", "segmentation", "--image-size", str(SIZE)]
    with ProducerProcess(data, extra_args=args_) as producer, ZMQInput([producer.endpoint]) as inp:
        inputs = tf.keras.Input((SIZE, SIZE, 3), dtype="uint8")
        x = tf.keras.layers.Rescaling(1 / 255)(inputs)
        x = tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu")(x)
        x = tf.keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x)
        x = tf.keras.layers.UpSampling2D()(x)
        # background + one channel per class; the input learned its spec from the first batch, whose header names
        # the dataset's class count
        outputs = tf.keras.layers.Conv2D(inp.stats.dataset_classes + 1, 1)(x)
        model = tf.keras.Model(inputs, outputs)
        model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        history = model.fit(inp.as_dataset(x="images", y="masks"), steps_per_epoch=args.steps, epochs=1, verbose=2,
                            callbacks=[inp.keras_callback()])
    print(f"final loss {history.history['loss'][-1]:.3f}, pixel accuracy {history.history['accuracy'][-1]:.2f}")


if __name__ == "__main__":
    main()
