"""Measure each trainer-side stage on its own: what arrives over the network, and the step alone.

``measure_link``: images/s and MB/s that reach this host from producers (receive and
validate only; no TensorFlow work). ``measure_constant_step``: steps/s of a training
step on constant input already in the graph (the trainer's ceiling, like
tensorpack's DummyConstantInput). ``diagnose`` compares the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class LinkRate:
    images_per_s: float
    mb_per_s: float
    batches: int
    per_producer: dict[str, int]


def measure_link(addresses: Sequence[str], seconds: float = 5.0, warmup_batches: int = 3,
                 timeout: float = 30.0) -> LinkRate:
    """Receive from every producer for ``seconds`` after a warm-up, as a plain-mode trainer does (``BatchStream``: the
    same receive path and the same diagnosis), so nothing more than receiving and validating is measured.

    Raises what the input raises: ``InputModeError`` at once when the producers run exact mode (a plain receive
    cannot take their batches, and an exact one would consume records of their job), ``InputMismatchError`` for
    batches that never match, ``InputTimeoutError`` when no acceptable batch arrived for ``timeout`` s, saying why
    (unreachable addresses, rejected messages, failed handshakes).
    """
    from stoker.consumer.numpy.batch_stream import BatchStream

    with BatchStream(list(addresses), recv_timeout=timeout) as stream:
        for _ in range(warmup_batches):
            next(stream)
        start, t0 = stream.stats, time.perf_counter()
        images, nbytes, batches = 0, 0, 0
        while time.perf_counter() - t0 < seconds:
            batch = next(stream)
            batches += 1
            images += len(batch["labels"]) if "labels" in batch else 0
            nbytes += sum(a.nbytes for a in batch.values())
        elapsed, end = time.perf_counter() - t0, stream.stats
    per = {p: n - start.per_producer.get(p, 0) for p, n in end.per_producer.items()
           if n > start.per_producer.get(p, 0)}
    return LinkRate(images / elapsed, nbytes / elapsed / 1e6, batches, per)


def measure_constant_step(model_name: str, batch_size: int, image_size: int, num_classes: int = 1000,
                          steps: int = 20, warmup: int = 3) -> float:
    """Images/s of the training step on constant input (no input pipeline at all)."""
    import tensorflow as tf

    from stoker.consumer.train.models import build_model

    model = build_model(model_name, image_size, num_classes)
    optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    images = tf.constant(np.random.default_rng(0).integers(0, 255, (batch_size, image_size, image_size, 3),
                                                           dtype=np.uint8))
    labels = tf.constant(np.arange(batch_size, dtype=np.int32) % num_classes)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return batch_size / mean_step_seconds(step, steps, warmup)


def mean_step_seconds(step: Callable[[], Any], steps: int, warmup: int) -> float:
    """Mean seconds per call of ``step`` (a training step returning its loss) over ``steps`` calls after
    ``warmup``; the last loss is read back, so the time includes all the work queued."""
    for _ in range(warmup):
        float(step())
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    float(loss)
    return (time.perf_counter() - t0) / steps


@dataclass(frozen=True)
class Diagnosis:
    link_images_per_s: float
    trainer_images_per_s: float
    link_mb_per_s: float
    producers_seen: int
    producer_stage_pipeline: Optional[float] = None  # images/s of one worker, if the LMDB was given
    device: Optional[str] = None  # where the step ran ("GPU", "CPU": ``training_device()``); None: not known

    def speed_up_the_step(self) -> str:
        """How to make the model step faster, for the device it ran on."""
        if self.device == "CPU":
            return ("the step ran on the CPU: train on a GPU or another accelerator, or make the step cheaper (a "
                    "smaller model, fewer or smaller layers, a smaller --image-size)")
        if self.device == "GPU":
            return "mixed precision, XLA, a bigger GPU"
        return "mixed precision, XLA, a faster accelerator"

    def sentence(self) -> str:
        link, train = self.link_images_per_s, self.trainer_images_per_s
        if link < 0.95 * train:
            need = train / max(link, 1e-9)
            advice = (f"add producers or workers (about {need:.1f}x the current input rate is needed)")
            if self.producer_stage_pipeline:
                workers = train / self.producer_stage_pipeline
                advice += f"; one worker makes {self.producer_stage_pipeline:.0f} images/s, so ~{workers:.0f} workers in all"
            advice += ", or shrink the batch's bytes (smaller --image-size) if the network is the limit"
            return (f"input-bound: producers deliver {link:.0f} images/s ({self.link_mb_per_s:.0f} MB/s) but the "
                    f"step could take {train:.0f} images/s; {advice}.")
        return (f"training-bound: producers deliver {link:.0f} images/s and the step takes {train:.0f} images/s; "
                f"the input keeps up, so speed up the model step ({self.speed_up_the_step()}).")


def training_device() -> str:
    """Where TensorFlow places a training step by default, as ``measure_constant_step`` runs it: ``"GPU"`` when it
    sees one, else ``"CPU"``."""
    import tensorflow as tf

    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
