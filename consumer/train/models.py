"""Models ``stoker train`` can train. Each takes uint8 RGB images and rescales them itself."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

MODELS = ("small-cnn", "resnet50")


def build_model(name: str, image_size: int | tuple[int, int], num_classes: int) -> tf.keras.Model:
    """``small-cnn``: 3 strided convs, fast on CPU. ``resnet50``: keras.applications, weights=None. ``image_size``:
    the side of square images, or (height, width)."""
    keras = tf.keras
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    inputs = keras.Input((height, width, 3), dtype="uint8")
    x = keras.layers.Rescaling(1 / 127.5, offset=-1.0)(inputs)
    if name == "small-cnn":
        for filters in (32, 64, 128):
            x = keras.layers.Conv2D(filters, 3, strides=2, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(num_classes)(x)
    elif name == "resnet50":
        backbone = keras.applications.ResNet50(weights=None, include_top=False, input_shape=(height, width, 3),
                                               pooling="avg")
        outputs = keras.layers.Dense(num_classes)(backbone(x))
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return keras.Model(inputs, outputs, name=name.replace("-", "_"))


#: The class count of a model when neither ``--classes`` nor the producers' dataset names one.
DEFAULT_CLASSES = 1000


class ClassCountError(ValueError):
    """``--classes`` is below the classes of the producers' dataset: labels would fall outside the model."""


def model_classes(requested: Optional[int], dataset_classes: int) -> int:
    """The class count to build a model with: ``requested`` (``--classes``) held to the classes the producers'
    dataset names in its batch headers (0: not said), else the dataset's, else ``DEFAULT_CLASSES``.

    Raises ClassCountError naming the flag to pass when ``requested`` is below the dataset's classes.
    """
    if requested is None:
        return dataset_classes or DEFAULT_CLASSES
    if dataset_classes and requested < dataset_classes:
        raise ClassCountError(f"--classes {requested} is below the {dataset_classes} classes of the producers' "
                              f"dataset (their batch headers say so; `stoker lmdb info DATASET` lists them): labels "
                              f"up to {dataset_classes - 1} would fall outside the model; pass --classes "
                              f"{dataset_classes}, or leave --classes out to take the dataset's")
    return requested
