"""Keras callback for ZMQInput: occupancy in logs and TensorBoard, input errors raised."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import tensorflow as tf

from stoker.consumer.tf.summaries import require_tensorboard

if TYPE_CHECKING:
    from stoker.consumer.receive.input_stats import WatchedInput

    class SummarizedInput(WatchedInput):
        def write_summaries(self, step: int) -> None: ...

log = logging.getLogger("stoker.consumer")


class ZMQInputCallback(tf.keras.callbacks.Callback):
    """Every ``log_every`` batches: log occupancy and images/s, write TensorBoard scalars to ``logdir``.

    Keras treats an exhausted dataset as the end of an epoch; this callback turns
    that into the input's own error (timeout naming the producers) at epoch end.
    Raises TensorBoardNotInstalledError at construction if ``logdir`` is set and
    TensorBoard is not installed.
    """

    def __init__(self, inp: "SummarizedInput", log_every: int = 50, logdir: Optional[str] = None) -> None:
        require_tensorboard(logdir, "ZMQInput.keras_callback(logdir=...)")
        super().__init__()
        self.inp = inp
        self.log_every = log_every
        self.writer = tf.summary.create_file_writer(logdir) if logdir else None
        self._step = 0
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self._step += 1
        if self._step % self.log_every:
            return
        now = time.perf_counter()
        rate = self.log_every * self.inp.batch_size / (now - self._t)
        self._t = now
        occupancy = self.inp.queue_occupancy()
        log.info("step=%d images_per_s=%.1f queue_occupancy=%.2f", self._step, rate, occupancy)
        if self.writer is not None:
            with self.writer.as_default():
                self.inp.write_summaries(self._step)
                tf.summary.scalar("stoker/images_per_s", rate, step=self._step)

    def on_epoch_end(self, epoch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self.inp.raise_if_failed()

    def on_train_end(self, logs: Optional[dict[str, Any]] = None) -> None:
        if self.writer is not None:
            self.writer.flush()
        self.inp.raise_if_failed()
