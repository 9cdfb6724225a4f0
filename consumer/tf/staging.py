"""A StagingArea on the training device, built on ``tf.raw_ops.Stage``/``Unstage``.

tensorpack's StagingInput pattern in TF2: the area is pre-filled, and each step
unstages the batch staged by the step before while staging the next one, so the
host-to-device copy overlaps the training step. The ops are stateful and keyed
by ``shared_name`` in the device's resource manager, so eager calls and calls
inside ``tf.function`` see the same area.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import tensorflow as tf

_ids = itertools.count()


def training_devices(device: Optional[str], devices: Optional[Sequence[str]],
                     strategy: Optional[tf.distribute.Strategy]) -> list[str]:
    """The devices to stage batches on: one of ``device``, ``devices`` or ``strategy``'s, else ``/GPU:0`` when
    TensorFlow sees a GPU, else ``/CPU:0``. ValueError naming the fix for a conflicting or empty choice."""
    if sum(x is not None for x in (device, devices, strategy)) > 1:
        raise ValueError("give one of device, devices or strategy")
    if strategy is not None:
        devices = list(strategy.extended.worker_devices)
    if devices is not None:
        if not devices:
            raise ValueError("devices must name at least one device, e.g. ['/GPU:0', '/GPU:1']")
        return list(devices)
    return [device or ("/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0")]


class StagingArea:
    """Holds up to ``capacity`` staged element tuples on ``device``.

    ``get()`` asserts the area is non-empty before unstaging: Unstage on an empty
    area would block forever, and an error beats a hang.
    """

    def __init__(self, dtypes: Sequence[tf.DType], device: str, capacity: int = 2, name: str = "stoker_staging") -> None:
        self.dtypes = list(dtypes)
        self.device = device
        self._attrs = dict(capacity=capacity, memory_limit=0, container="", shared_name=f"{name}_{next(_ids)}")

    def put(self, values: Sequence[tf.Tensor]) -> tf.Operation:
        with tf.device(self.device):
            return tf.raw_ops.Stage(values=list(values), **self._attrs)

    def get(self) -> list[tf.Tensor]:
        with tf.device(self.device):
            tf.debugging.assert_positive(
                self.size(), message="stoker: StagingArea is empty because the input failed; see the ZMQInput error"
            )
            return tf.raw_ops.Unstage(dtypes=self.dtypes, **self._attrs)

    def size(self) -> tf.Tensor:
        with tf.device(self.device):
            return tf.raw_ops.StageSize(dtypes=self.dtypes, **self._attrs)

    def clear(self) -> None:
        with tf.device(self.device):
            tf.raw_ops.StageClear(dtypes=self.dtypes, **self._attrs)
