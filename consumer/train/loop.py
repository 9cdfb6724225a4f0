"""The trainer behind ``stoker train`` and ``stoker demo``: a Keras model, a tf.function step, ZMQInput.

The step takes its batch from ``ZMQInput.get()`` (StagingArea), so receive,
decode, copy-to-TF and copy-to-device all overlap the computation. A progress
bar shows images/s and queue occupancy; TensorBoard scalars go to ``logdir``.
This module runs a training from its settings (``TrainConfig``) to what it measured:
the steps themselves are in ``steps.py``, the measurements and their summary in
``run_summary.py``, which side limited training in ``verdict.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import tensorflow as tf

from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.placement.local_producer import LocalProducer

from stoker.consumer.receive.errors import InputMismatchError
from stoker.consumer.train.checkpoints import CheckpointMismatchError, RunSettings, TrainCheckpoints
from stoker.consumer.train.interrupts import close_on_signal
from stoker.consumer.train.models import ClassCountError, build_model, model_classes
from stoker.consumer.train.report import write_report
from stoker.consumer.train.steps import LABEL_OUTSIDE, Progress, StepsRun, run_steps, train_step
from stoker.consumer.tf.summaries import require_tensorboard
from stoker.consumer.train.run_summary import TrainReport
from stoker.consumer.train.timeline import Timeline
from stoker.consumer.tf.zmq_input import ZMQInput

log = logging.getLogger("stoker.consumer")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (the flags of ``stoker train``)."""

    addresses: Sequence[str]
    model: str = "small-cnn"
    steps: int = 1000  # the run's, counted from step 0 of a fresh start: a resumed run goes on to it
    batch_size: Optional[int] = None  # None: the producers' (learned from them, as image_size)
    image_size: Optional[int] = None
    num_classes: Optional[int] = None  # None: the producers' dataset's (``models.model_classes``)
    queue_capacity: int = 50
    recv_timeout: float = 60.0
    logdir: Optional[str] = None
    log_every: int = 50
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    progress: bool = True
    curve: Optional[CurveClientKeys] = None
    metrics_port: Optional[int] = None
    exact: bool = False  # producers run --exact / --epochs N; a finite run ends training early
    trainer_id: Optional[str] = None
    consumed_log: Optional[str] = None  # JSON lines: each step's record indices and epochs
    report: Optional[str] = None  # write the bottleneck report (HTML) here at the end
    timeline: bool = False  # record a Timeline even without a report (stoker doctor writes its own)
    receive: str = "auto"  # or "direct" / "libzmq": ZMQInput(receive=...)
    discover_every: float = 5.0  # seconds between re-resolving producer names (an elastic pool)
    share: tuple[int, int] = (0, 1)  # (rank, world) of an elastic pool's splits
    stall_after: Optional[float] = 10.0  # seconds: a producer holding work that sends nothing new is stuck
    stall_limit: Optional[float] = 300.0  # seconds: a stuck fixed-shard producer fails the input (exact mode)
    checkpoint_dir: Optional[str] = None  # model, optimizer, step and input state saved here (checkpoints.py)
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end and on Ctrl-C/SIGTERM)
    resume: bool = False  # continue from checkpoint_dir's latest checkpoint (none there: start afresh)
    local_producer: Optional[LocalProducer] = None  # a producer started on this host (consumer/placement/)


def _open_input(config: TrainConfig, stack: contextlib.ExitStack) -> tuple[ZMQInput, threading.Event]:
    """The run's input and the event a signal sets; closed ``SIGNAL_GRACE`` s after Ctrl-C/SIGTERM (the loop ends
    after a whole step first) and with the stack; metrics served if asked. The batches are the producers' where
    ``--batch-size``/``--image-size`` are not both given (``_check_batches`` holds the one given to them)."""
    both = config.batch_size is not None and config.image_size is not None
    inp = stack.enter_context(ZMQInput(
        config.addresses, batch_size=config.batch_size if both else None,
        image_shape=(config.image_size, config.image_size, 3) if both else None,
        queue_capacity=config.queue_capacity, recv_timeout=config.recv_timeout, curve=config.curve,
        exact=config.exact, trainer_id=config.trainer_id, receive=config.receive,
        discover_every=config.discover_every, share=config.share, stall_after=config.stall_after,
        stall_limit=config.stall_limit, local_producer=config.local_producer))
    interrupted = stack.enter_context(close_on_signal(inp.close, SIGNAL_GRACE))
    if config.metrics_port is not None:
        log.info("metrics on http://0.0.0.0:%d/metrics", inp.serve_metrics(config.metrics_port))
    return inp, interrupted


#: Seconds after Ctrl-C/SIGTERM before the input is closed under a step still waiting for data.
SIGNAL_GRACE = 5.0


def _check_batches(config: TrainConfig, inp: ZMQInput) -> tuple[int, int]:
    """The batch size and image (height, width) the producers send, held to ``--batch-size``/``--image-size`` where
    given; InputMismatchError naming the flag otherwise, or for batches without ``images``/``labels``."""
    if "images" not in inp.spec or "labels" not in inp.spec or len(inp.spec["images"].shape) != 4:
        raise InputMismatchError(f"stoker train trains on images [B,H,W,3] and labels [B] (the imagenet pipeline); "
                                 f"the producers send {inp.spec}")
    batch, height, width = (int(d) for d in inp.spec["images"].shape[:3])
    for flag, given, sent in (("--batch-size", config.batch_size, batch), ("--image-size", config.image_size, height),
                              ("--image-size", config.image_size, width)):
        if given is not None and given != sent:
            raise InputMismatchError(f"{flag} {given}, but the producers send batches of {batch} images of "
                                     f"{height}x{width}: pass {flag} {sent}, or leave it out to take theirs")
    return batch, (height, width)


def _dataset_classes(inp: ZMQInput) -> int:
    """The classes the producers' dataset names, read from the first batch's header (0: not said). Waits for that
    batch; bounded by the input's ``recv_timeout`` (the input fails then) and ended by ``close()`` or Ctrl-C. Exact
    mode receives from here on: restore any checkpoint before."""
    inp.activate()
    while not inp.stats.batches and not inp.finished:
        inp.raise_if_failed()
        time.sleep(0.02)
    return inp.stats.dataset_classes


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended ``train`` after a whole step: ``report`` is what the run measured (its HTML report
    and its checkpoint written, where asked)."""

    def __init__(self, report: TrainReport) -> None:
        super().__init__("interrupted by signal")
        self.report = report


def train(config: TrainConfig) -> TrainReport:
    """Train ``config.model`` for ``config.steps`` steps on batches from ``config.addresses``.

    Raises TensorBoardNotInstalledError before anything starts if ``logdir`` is set and
    TensorBoard is missing; InputTimeoutError if producers are silent for ``recv_timeout``;
    ClassCountError when ``num_classes`` is below the classes the producers' dataset names (checked on the first
    batch, before the model is built) or a label falls outside the model; InputMismatchError when the producers'
    batches are not the ``batch_size``/``image_size`` given; CheckpointMismatchError when ``checkpoint_dir`` may not
    be resumed (``checkpoints.py``); TrainingInterrupted on Ctrl-C/SIGTERM after a whole step (a checkpoint saved
    and the report written first; after zero steps too, once training began), KeyboardInterrupt when the signal
    came before training began (TrainingInterrupted is a KeyboardInterrupt: the CLI exits 130 either way).
    """
    require_tensorboard(config.logdir, "training with a log directory (stoker train --logdir)")
    checkpoints = TrainCheckpoints(config.checkpoint_dir) if config.checkpoint_dir else None
    saved = checkpoints.saved_settings(config.resume) if checkpoints else None
    result: Optional[TrainReport] = None
    try:
        with contextlib.ExitStack() as stack:
            result = _train(config, stack, checkpoints, saved)
            return result
    except KeyboardInterrupt:
        if result is None:
            raise
        raise TrainingInterrupted(result) from None


def _train(config: TrainConfig, stack: contextlib.ExitStack, checkpoints: Optional[TrainCheckpoints],
           saved: Optional[RunSettings]) -> TrainReport:
    keras = tf.keras
    optimizer = keras.optimizers.Adam(config.learning_rate)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    writer = tf.summary.create_file_writer(config.logdir) if config.logdir else tf.summary.create_noop_writer()
    consumed_log = stack.enter_context(open(config.consumed_log, "a" if saved else "w")) if config.consumed_log else None
    inp, interrupted = _open_input(config, stack)
    batch_size, image_shape = _check_batches(config, inp)
    settings = RunSettings(config.model, config.num_classes or (saved.classes if saved else 0), batch_size, image_shape,
                           config.exact, config.share, config.trainer_id or (saved.trainer_id if saved else None),
                           saved.streams if saved else ())

    def check_resume() -> None:  # the flags at once; the producers' streams once batches came, and at each save
        nonlocal settings
        settings = dataclasses.replace(settings, streams=tuple(sorted(
            set(settings.streams) | set(inp.stats.producer_streams.values()))))
        if saved is not None and saved.mismatches(settings):
            raise CheckpointMismatchError(f"--resume: {config.checkpoint_dir} was saved by another run: "
                                          f"{'; '.join(saved.mismatches(settings))}; pass what it was saved with, "
                                          "or give another --checkpoint-dir")

    check_resume()
    log.info("waiting for the first batches from %s (pre-filling the queue)",  # the local producer's address too
             "the discovered producers" if callable(inp.addresses) else ", ".join(inp.addresses))
    # A resumed model is built with the saved classes before the input receives (its state is restored first).
    classes = saved.classes if saved else model_classes(config.num_classes, _dataset_classes(inp))
    model = build_model(config.model, image_shape, classes)
    optimizer.build(model.trainable_variables)
    step_number = tf.Variable(0, dtype=tf.int64, name="step")
    if checkpoints is not None:
        checkpoints.attach(model=model, optimizer=optimizer, step=step_number, input=inp)
        if saved is not None:
            checkpoints.restore()
            model_classes(classes, _dataset_classes(inp))  # the dataset may not name more classes than the model
            check_resume()
    settings = dataclasses.replace(settings, classes=classes, trainer_id=inp.trainer_id)
    start = int(step_number.numpy())
    log.info("model %s with %d classes%s%s", config.model, classes,
             "" if config.num_classes or saved else " (the producers' dataset's; --classes sets another)",
             f", resumed at step {start}" if saved else "")

    def save(i: int) -> None:
        assert checkpoints is not None
        check_resume()
        step_number.assign(i)
        checkpoints.save(i, settings)

    def after_step(i: int) -> None:
        if checkpoints is not None and config.checkpoint_every and i % config.checkpoint_every == 0:
            save(i)

    step = train_step(inp, model, optimizer, loss_fn, classes)
    timeline = Timeline(inp).start() if config.report or config.timeline else None
    if timeline is not None:
        stack.callback(timeline.stop)  # also on errors; a second stop() does nothing
    progress = Progress(config, inp, consumed_log, batch_size, start)
    warmup = min(config.warmup_steps, max(0, config.steps - start - 1))
    with writer.as_default():
        try:
            run = run_steps(config, inp, step, progress, timeline, warmup, interrupted, start, after_step)
        except tf.errors.InvalidArgumentError as exc:
            if LABEL_OUTSIDE not in str(exc):
                raise
            raise ClassCountError(f"a batch holds a label at or above the model's {classes} classes: pass "
                                  "--classes above the largest label the producers' pipeline makes (`stoker "
                                  "lmdb info DATASET` lists the dataset's classes)") from None
    progress.close()
    writer.flush()
    end = start + run.steps
    if checkpoints is not None and run.steps and not (config.checkpoint_every and end % config.checkpoint_every == 0):
        save(end)  # the end, clean or by a signal: every step trained is in a checkpoint
    return _report(config, inp, run, warmup, timeline, batch_size)


def _report(config: TrainConfig, inp: ZMQInput, run: StepsRun, warmup: int, timeline: Optional[Timeline],
            batch_size: int) -> TrainReport:
    """What the run measured (``TrainReport``), its HTML report written if asked."""
    if timeline is not None:
        timeline.stop()
    seconds = time.perf_counter() - run.t_start
    stats_end, stats_start = inp.stats, run.stats_start
    # The clock restarted after the warm-up step; a run that never got past it is timed whole.
    includes_warmup = warmup == 0 or run.steps <= warmup
    measured = run.steps if includes_warmup else run.steps - warmup
    samples = stats_end.occupancy_samples - stats_start.occupancy_samples
    mean_occ = ((stats_end.occupancy_sum - stats_start.occupancy_sum) / samples) if samples else stats_end.mean_queue_occupancy
    result = TrainReport(steps=run.steps, seconds=seconds, images_per_s=measured * batch_size / seconds,
                         mean_queue_occupancy=mean_occ, final_loss=run.final_loss, final_accuracy=run.final_accuracy,
                         input_stats=stats_end, timeline=timeline, includes_warmup=includes_warmup,
                         stats_at_start=stats_start, logdir=config.logdir)
    if config.report and timeline is not None:
        write_report(config.report, f"stoker train: {config.model}", result.bottleneck(), timeline, result.facts())
        result.report_path = config.report
        log.info("wrote the bottleneck report to %s", config.report)
    return result
