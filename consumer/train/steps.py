"""The steps of ``stoker train``: the tf.function step, the progress it shows, and the loop that runs them.

``run_steps`` runs steps ``start + 1 .. config.steps`` (``start``: the step a checkpoint was saved at) and ends
early, after a whole step, when the producers' finite run ends or a signal came (``interrupted``, set by
``interrupts.close_on_signal``); ``after_step(i)`` runs after each (the checkpoint every N steps).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO

import tensorflow as tf
from tqdm import tqdm

from stoker.consumer.receive.input_stats import InputStats
from stoker.consumer.train.timeline import Timeline
from stoker.consumer.tf.zmq_input import ZMQInput

if TYPE_CHECKING:
    from stoker.consumer.train.loop import TrainConfig

log = logging.getLogger("stoker.consumer")

#: In the message of a step whose batch holds a label the model has no class for.
LABEL_OUTSIDE = "stoker: a label is outside the classes of the model"


def train_step(inp: ZMQInput, model: Any, optimizer: Any, loss_fn: Any,
               classes: int) -> Callable[[], tuple[tf.Tensor, ...]]:
    """One training step on the input's next batch: ``(loss, accuracy, index, epoch)``; a label outside the model's
    ``classes`` fails the step with ``LABEL_OUTSIDE`` in its message (``train`` says which flag to change)."""
    @tf.function
    def step() -> tuple[tf.Tensor, ...]:
        batch = inp.get()
        images, labels = batch["images"], batch["labels"]
        tf.debugging.assert_less(labels, classes, message=LABEL_OUTSIDE)
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32))
        return loss, accuracy, batch["index"], batch["epoch"]
    return step


class Progress:
    """The progress bar, the log line every ``log_every`` steps and TensorBoard scalars; the consumed-record log."""

    def __init__(self, config: "TrainConfig", inp: ZMQInput, consumed_log: Optional[TextIO], batch_size: int,
                 start: int = 0) -> None:
        self.config, self.inp, self.consumed_log, self.batch_size = config, inp, consumed_log, batch_size
        self.bar = tqdm(total=config.steps, initial=start, unit="step", disable=not config.progress,
                        dynamic_ncols=True)
        self.t_window, self.start = time.perf_counter(), start

    def step(self, i: int, loss: tf.Tensor, accuracy: tf.Tensor, index: tf.Tensor, epoch: tf.Tensor) -> None:
        config = self.config
        if self.consumed_log is not None:
            self.consumed_log.write(json.dumps({"step": i, "index": index.numpy().tolist(),
                                                "epoch": epoch.numpy().tolist()}) + "\n")
            if i % 10 == 0:
                self.consumed_log.flush()  # read as it grows (stoker cluster prints images/s from it)
        if i % config.log_every == 0 or i == config.steps:
            now = time.perf_counter()
            rate = min(config.log_every, i - self.start) * self.batch_size / (now - self.t_window)
            self.t_window = now
            occupancy = self.inp.queue_occupancy()
            self.bar.set_postfix(img_s=f"{rate:.0f}", queue=f"{occupancy:.2f}", loss=f"{float(loss):.3f}")
            if not config.progress:
                log.info("step=%d images_per_s=%.1f queue_occupancy=%.2f loss=%.3f", i, rate, occupancy, float(loss))
            if config.logdir:  # tf.summary needs TensorBoard even with a no-op writer
                self.inp.write_summaries(i)
                tf.summary.scalar("train/loss", loss, step=i)
                tf.summary.scalar("train/accuracy", accuracy, step=i)
                tf.summary.scalar("stoker/images_per_s", rate, step=i)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.consumed_log is not None:
            self.consumed_log.flush()


@dataclass
class StepsRun:
    """What ``run_steps`` did: ``steps`` run by this process (from ``start``), the clock's start (restarted after
    the warm-up) and the stats then, the last loss and accuracy, and whether a signal ended it."""

    steps: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    stats_start: InputStats = field(default_factory=InputStats)
    final_loss: float = float("nan")
    final_accuracy: float = float("nan")
    interrupted: bool = False


def run_steps(config: "TrainConfig", inp: ZMQInput, step: Callable[[], tuple[tf.Tensor, ...]], progress: Progress,
              timeline: Optional[Timeline], warmup: int, interrupted: threading.Event, start: int = 0,
              after_step: Callable[[int], None] = lambda i: None) -> StepsRun:
    """Run steps ``start + 1 .. config.steps``, fewer when a finite run ends or ``interrupted`` is set (checked
    between steps; a step the closed input cancelled ends the run too); the clock restarts after step ``warmup``
    of this run."""
    run = StepsRun(stats_start=inp.stats)
    loss = accuracy = None
    for i in range(start + 1, config.steps + 1):
        if interrupted.is_set():
            run.interrupted = True
            log.info("interrupted: stopping after step %d", i - 1)
            break
        try:
            t_step = time.perf_counter()
            loss, accuracy, index, epoch = step()
            if timeline is not None:  # the step's own time: wait for its result (costs a sync)
                float(loss)
                timeline.step(time.perf_counter() - t_step)
        except tf.errors.OpError as exc:
            if interrupted.is_set():  # the signal closed the input under this step
                run.interrupted = True
                log.info("interrupted: stopping after step %d", i - 1)
                break
            if not isinstance(exc, tf.errors.OutOfRangeError) or not inp.finished:
                raise
            log.info("the producers finished their epochs after %d steps", i - 1)
            break
        run.steps = i - start
        if run.steps == warmup:
            float(loss)  # wait for the step to finish before the clock starts
            run.t_start, run.stats_start = time.perf_counter(), inp.stats
        progress.step(i, loss, accuracy, index, epoch)
        after_step(i)
    if loss is not None:
        run.final_loss, run.final_accuracy = float(loss), float(accuracy)
    return run
