"""Detection: records with boxes written by write_lmdb, two producers, a tiny model trained on the boxes.

The built-in ``detection`` pipeline moves each image and its boxes through one random
crop (keeping every box), resize and flip; a batch carries ``images``, ``boxes``
(padded to ``max_boxes``), ``boxes_len`` (how many are real), ``classes`` and
``classes_len``. The model here is a toy that learns where the first object is and
what it is; a real detector (anchors, matching) would take the same batches.
"""

import argparse
import tempfile
from pathlib import Path

MAX_BOXES, SIZE, CLASSES = 8, 96, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument("--records", type=int, default=128, help="synthetic images")
    args = parser.parse_args()

    import tensorflow as tf

    from stoker.consumer import ZMQInput
    from stoker.producer.dataset.build.write_records import write_lmdb
    from stoker.producer.process import ProducerProcess
    from stoker.producer.dataset.build.synthetic import synthetic_record

    # Any iterable of dicts: an encoded image, boxes as float32 [n, 4] (x1, y1, x2, y2 pixels), classes.
    scratch = tempfile.TemporaryDirectory(prefix="stoker-example-")  # removed at exit
    data = Path(scratch.name) / "boxes"
    write_lmdb(data, (synthetic_record("detection", 0, i, CLASSES) for i in range(args.records)), task="detection")

    common = ["--workers", "1", "--batch-size", "8", "--pipeline", "detection", "--image-size", str(SIZE),
              "--pipeline-arg", f"max_boxes={MAX_BOXES}"]
    with ProducerProcess(data, extra_args=[*common, "--shard", "0/2"]) as a, \
            ProducerProcess(data, extra_args=[*common, "--shard", "1/2"]) as b, \
            ZMQInput([a.endpoint, b.endpoint]) as inp:

        def first_object(images, targets):  # padded boxes -> the first real box (scaled to 0..1) and its class
            boxes, classes = targets
            return images, {"box": boxes[:, 0] / SIZE, "cls": classes[:, 0]}

        dataset = inp.as_dataset(x="images", y=("boxes", "classes")).map(first_object)
        inputs = tf.keras.Input((SIZE, SIZE, 3), dtype="uint8")
        x = tf.keras.layers.Rescaling(1 / 255)(inputs)
        for filters in (16, 32, 64):
            x = tf.keras.layers.Conv2D(filters, 3, strides=2, activation="relu")(x)
        x = tf.keras.layers.GlobalAveragePooling2D()(x)
        model = tf.keras.Model(inputs, {"box": tf.keras.layers.Dense(4, activation="sigmoid", name="box")(x),
                                        "cls": tf.keras.layers.Dense(CLASSES, name="cls")(x)})
        model.compile("adam", loss={"box": "mae", "cls": tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)})
        history = model.fit(dataset, steps_per_epoch=args.steps, epochs=1, verbose=2, callbacks=[inp.keras_callback()])
        batch = inp.get()
        print(f"a batch: boxes {batch['boxes'].shape}, objects per image {batch['boxes_len'].numpy().tolist()}")
    print(f"final loss {history.history['loss'][-1]:.3f}")


if __name__ == "__main__":
    main()
