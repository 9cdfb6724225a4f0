"""ZMQInput: batches from producer daemons into TensorFlow with every copy hidden; the public facade.

    producers --> receiver (direct ZMTP | libzmq PULL | exact DEALERs) --> ReceiveCore --> TFFeeder
                  (receive/core: sockets, validation, silence)              (FIFOQueue, StagingArea, get())

``ZMQInput`` turns its arguments into one ``ReceiveOptions`` (``input_setup.InputOptions``), opens a
``ReceiveCore`` over the chosen transport (``InputBase``, shared with every facade) and feeds a
``TFFeeder`` (``tf/feeder.py``) from it; exact mode's state goes in and out as bytes through the
``ConsumedLedger`` (``exact/ledger.py``). Each layer has its module and its own docstring; the map of
the house is in docs/decisions.md. Any pipeline's arrays travel this way; ZMQInput never
looks inside them.

Bad messages are counted, logged (rate-limited) and dropped, and receiving carries on. If no
batch arrives for ``recv_timeout`` seconds the queue is closed: the training step fails with
InputTimeoutError naming the producer addresses instead of waiting forever. ``close()`` (or
leaving the ``with`` block) cancels pending queue operations, stops the threads and closes
the sockets within about two seconds.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

import tensorflow as tf

from stoker.protocol import DEFAULT_MAX_MESSAGE_BYTES
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.tf.batch_tensors import BatchTensors, Selection
from stoker.consumer.receive.errors import InputClosedError
from stoker.consumer.input_base import InputBase
from stoker.consumer.input_setup import InputOptions
from stoker.consumer.placement.local_producer import LocalProducer
from stoker.consumer.receive.input_stats import InputStats
from stoker.consumer.tf.feeder import TFFeeder
from stoker.consumer.tf.staging import training_devices

log = logging.getLogger("stoker.consumer")

__all__ = ["InputStats", "ZMQInput"]


class ZMQInput(InputBase, tf.train.experimental.PythonState):
    """Feed a TensorFlow training step from Stoker producers, for any pipeline.

    Args:
        addresses: producer addresses, e.g. ``["tcp://hostA:5555", "tcp://hostB:5555"]``
            (a comma-separated string works too). A host *name* stands for every address it
            resolves to, resolved again every ``discover_every`` seconds: with a Kubernetes headless
            Service (``tcp://stoker-producer.NS.svc:5555``) the input follows ``kubectl scale``,
            connecting to producers that appear and dropping those that vanish. A callable returning
            addresses plugs in any other discovery (consumer/transport/discovery.py).
        discover_every: seconds between re-resolving names (default 5; 0: resolve once).
        share: ``(rank, world)``, exact mode with an elastic pool (producers ``--shard auto``):
            this trainer hands out, and trains on, the splits ``s`` of each epoch with
            ``s % world == rank``; data-parallel trainers give their rank and number.
        stall_after: seconds (default 10) a producer holding work may send nothing new while the
            step waits before it counts as stuck: an elastic pool hands its splits to the other
            producers (a floor: a pool whose producers go longer between batches waits 4x that gap); every
            input logs once what it waits for. None: off.
        stall_limit: exact mode with fixed shards (default 300 s): a producer stuck this long
            fails the input with an error naming it (no other producer can serve its shard;
            warnings come before, at a growing interval). None: warn only.
        producers_per_trainer: a partitioned pool (default None: read every address): this trainer reads
            only ``partition(addresses, *share, k)`` (consumer/exact/pool/partition.py), ``k`` of them.
        local_producer: a producer to start on this host (default None): ``LocalProducer(data, workers,
            pipeline, extra_flags, cpus, nice)`` with the remote producers' dataset and flags; it serves over
            ``ipc://`` at lower priority (nice +10), is one more producer of the pool (id ``local-...``) and
            is stopped at ``close()``; the input then receives through libzmq. See consumer/placement/.
        batch_size, image_shape: the ``imagenet`` pipeline's batches (images uint8
            ``[batch_size, *image_shape]``, labels int32): give either (the other defaults to 64
            or ``(224, 224, 3)``) as a shortcut for its ``spec``.
        spec: the arrays every batch must carry (a ``stoker.protocol.batch_spec.BatchSpec`` or
            ``{"images": ("uint8", [64, 224, 224, 3]), ...}``; ``index`` and ``epoch`` are added if
            missing). Without a spec, ``batch_size`` or ``image_shape``, the constructor waits (up to
            ``recv_timeout``) for the first batch and holds every producer to what it carries. A
            producer that disagrees is rejected with a message naming both specs.
        queue_capacity: FIFOQueue capacity in batches (default 50). Memory held is at most
            ``max_batches_held() * batch bytes``: the queue, the staged batches, the step's,
            the receive thread's, and ``rcvhwm + 1`` per producer address.
        device: where the StagingArea lives (default: ``/GPU:0`` when TensorFlow sees a GPU,
            else ``/CPU:0``).
        devices, strategy: several training devices, e.g. ``["/GPU:0", "/GPU:1"]``, or the devices
            of a ``tf.distribute`` strategy (``MirroredStrategy``): one StagingArea per device,
            each pre-filled, and inside ``strategy.run(replica_fn)`` ``get()`` returns that
            replica's own whole producer batch, already staged on its device.
        recv_timeout: seconds without an acceptable batch before the step fails with
            InputTimeoutError saying why (default 60).
        nr_stage: batches kept staged on the device (default 1, as tensorpack).
        rcvhwm: ZMQ receive high-water mark in batches, per producer connection (default 4).
        max_message_bytes: largest message accepted, enforced by the socket
            (``ZMQ_MAXMSGSIZE``) and by the decoder (default 512 MiB).
        curve: optional CurveZMQ client keys (``stoker.protocol.curve.load_client_keys``):
            traffic is encrypted and only producers holding the matching server key talk to us.
        exact: exact epochs (producers started with ``--exact`` or ``--epochs N``): each record once
            per epoch through producer crashes and trainer restarts. This input then owns the
            state of what its steps consumed: ``save_state()`` / ``resume_state=``, or pass it to
            ``tf.train.Checkpoint(model=..., input=inp)``. Rows that are padding (a finite run's last
            batch) are cut off: batches have their true size. A finite run ends: ``as_dataset()``
            stops, a ``tf.function`` step raises ``tf.errors.OutOfRangeError`` and an eager
            ``get()`` InputFinished, once every producer has finished (docs/decisions.md).
        resume_state, trainer_id: exact mode: start from a ``save_state()`` (its trainer id comes
            with it); ``trainer_id`` names this trainer to producers (default: random).
        receive: ``"auto"`` (default), ``"direct"`` or ``"libzmq"``. Direct receive reads each
            producer's stream ourselves (ZMTP over TCP or a Unix socket) straight into
            aligned memory TensorFlow then owns, saving the copy a libzmq frame needs, and bounds
            every message (memory: one batch per producer, whatever a peer sends; docs/security.md).
            ``"auto"`` uses it for ``tcp://`` and ``ipc://`` addresses without ``curve`` (plain and exact
            mode), libzmq otherwise (CurveZMQ). Producers are the same either way.

    Three ways in (runnable versions in README.md)::

        with ZMQInput(["tcp://127.0.0.1:5555"], batch_size=64) as inp:
            @tf.function
            def step():                        # 1. custom TF2 loop
                images, labels = inp.get()     #    staged on the training device; inp.get()["index"] too
                ...
            model.fit(inp.as_dataset(), steps_per_epoch=100)   # 2. Keras: (images, labels)
        # 3. tf.compat.v1 graph: build inside a Graph, then inp.start(session); see README.

    Errors: InputTimeoutError when no acceptable batch arrives within ``recv_timeout`` (the
    message says whether producers were silent, sent other shapes, or failed the handshake);
    InputError at once when every producer refused the handshake because it runs exact mode and
    this trainer does not (or the reverse), or, in exact mode, when two producers' shards overlap;
    InputClosedError after ``close()``. Inside a ``tf.function`` TensorFlow reports them as
    ``tf.errors.OutOfRangeError``; leaving the ``with`` block (or calling ``raise_if_failed()``)
    turns that into the clear error.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        batch_size: Optional[int] = None,
        image_shape: Optional[Sequence[int]] = None,
        queue_capacity: int = 50,
        device: Optional[str] = None,
        recv_timeout: float = 60.0,
        nr_stage: int = 1,
        rcvhwm: int = 4,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        curve: Optional[CurveClientKeys] = None,
        name: str = "stoker_input",
        spec: Optional[BatchSpec | Mapping[str, tuple[Any, Sequence[int]]]] = None,
        devices: Optional[Sequence[str]] = None,
        strategy: Optional[tf.distribute.Strategy] = None,
        exact: bool = False,
        resume_state: Optional[bytes] = None,
        trainer_id: Optional[str] = None,
        receive: str = "auto",
        discover_every: float = 5.0,
        share: tuple[int, int] = (0, 1),
        stall_after: Optional[float] = 10.0,
        stall_limit: Optional[float] = 300.0,
        producers_per_trainer: Optional[int] = None,
        local_producer: Optional[LocalProducer] = None,
    ) -> None:
        shared = InputOptions.from_arguments(locals())
        if nr_stage < 1:
            raise ValueError(f"nr_stage={nr_stage}: give batches >= 1 (default 1)")
        options = shared.receive_options()
        self.devices = training_devices(device, devices, strategy)
        self.device = self.devices[0]
        self.queue_capacity, self.recv_timeout, self.nr_stage, self.rcvhwm = queue_capacity, recv_timeout, nr_stage, rcvhwm
        self.name = name
        self._closed = False
        self._open_input(options, local_producer)
        if "images" in self.spec:
            self.image_shape = tuple(self.spec["images"].shape[1:])
            self.batch_shape = list(self.spec["images"].shape)
        # Exact mode: each batch also carries which producer it came from, to report its records there.
        ledger = self._ledger
        try:
            self._feeder = TFFeeder(
                self.spec, ledger.with_source(self.spec) if ledger else self.spec, queue_capacity, self.devices,
                nr_stage, name, lambda: self._core.error,
                f"the producers at {self._core.sources} finished their epochs: every record was delivered",
                record_consumed=ledger.consumed if ledger else None, activate=self._activate)
        except BaseException:
            self._core.close()
            raise
        if self._feeder.eager:
            self.start()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, session: Any = None) -> None:
        """Start receiving. Eager mode starts in the constructor; graph mode needs the Session here.

        Exact mode receives nothing until the first ``get()``, ``as_dataset()`` or (graph mode) this
        call, so a checkpoint restored before then decides what is served.
        """
        if not self._feeder.eager:
            self._activate()
            if session is None:
                raise ValueError("in tf.compat.v1 graph mode call inp.start(session) once the Session exists")
            if self._feeder.queue.session is None:  # type: ignore[union-attr]
                self._feeder.queue.session = session  # type: ignore[union-attr]
                if self.exact:
                    session.run(self._feeder.end_close_op)
        self._core.start(self._feeder)

    def close(self) -> None:
        """Stop the threads, cancel pending queue operations, close the sockets. Idempotent, bounded (<= 4 s)."""
        if self._closed:
            return
        self._closed = True
        self._core.close()
        self._stop_metrics()
        self._stop_local_producer()

    def activate(self) -> None:
        """Exact mode: receive from now on rather than from the first ``get()`` (a restore is refused after this,
        so call it once any checkpoint is restored). Plain mode receives from the start: nothing to do."""
        self._activate()

    def _activate(self) -> None:
        if self._ledger is not None:
            self._ledger.activate()  # the receive thread says hello on every connection from now on

    # tf.train.Checkpoint(input=inp): saved with the model, restored by checkpoint.restore()
    def serialize(self) -> bytes:
        return self.save_state() if self._ledger is not None else b""

    def deserialize(self, string_value: bytes) -> None:
        if string_value:
            self.restore_state(string_value)

    def __enter__(self) -> "ZMQInput":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        error = self._core.error
        failure = error if not isinstance(error, InputClosedError) else None
        self.close()
        # Inside tf.function the failure surfaces as OutOfRangeError (or autograph's StagingError
        # when it happens while tracing); re-raise it as the error that says what went wrong.
        if isinstance(exc, Exception) and failure is not None and exc is not failure:
            raise failure from exc

    # ---- the three ways in ------------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert
    def get(self) -> BatchTensors:
        """This step's batch, staged on the device: unpacks to the pipeline's fields, ``batch[name]`` for any array.

        ``images, labels = inp.get()`` for the imagenet pipeline; ``batch["boxes"]``,
        ``batch["boxes_len"]``, ``batch["index"]``, ``batch["epoch"]`` for the rest. Call it inside
        your ``tf.function`` step (recommended: unstage, dequeue and stage run in the step's graph,
        the copy overlapping the computation) or eagerly; with several devices, inside
        ``strategy.run(replica_fn)``, where each replica gets its own batch. The first call
        pre-fills the StagingAreas (waits for data).
        """
        return self._feeder.get()

    def dequeue(self) -> BatchTensors:
        """Plain dequeue tensors (no staging), named as ``get()``'s: for tf.compat.v1 graphs and tensorpack-style code."""
        return self._feeder.dequeue()

    def as_dataset(self, x: Optional[Selection] = None, y: Optional[Selection] = None,
                   combine: int = 1) -> tf.data.Dataset:
        """An infinite ``tf.data.Dataset`` of ``(x, y)`` batches for ``model.fit``.

        ``x`` and ``y`` each name one array, a sequence of arrays (a tuple) or a dict
        ``{key: array name}``; default ``x="images", y="labels"`` when the batches have both.
        ``y=()`` gives ``x`` alone. ``combine=k`` makes each element k producer batches joined
        (``k * batch_size`` rows): under ``MirroredStrategy`` over k replicas Keras splits an
        element evenly, so each replica trains on one whole producer batch (global batch
        ``k * batch_size``, per replica ``batch_size``); with ``combine=1`` each replica gets
        ``batch_size / k`` rows. Keras ends an epoch quietly when a dataset runs dry, so pair it
        with ``keras_callback()``, which raises the input's error instead.
        """
        return self._feeder.as_dataset(x, y, combine)

    def keras_callback(self, log_every: int = 50, logdir: Optional[str] = None) -> "tf.keras.callbacks.Callback":
        """A Keras callback: occupancy log line/TensorBoard scalar every ``log_every`` batches; raises input errors."""
        from stoker.consumer.tf.keras_callback import ZMQInputCallback

        return ZMQInputCallback(self, log_every=log_every, logdir=logdir)

    # ---- what a user watches ----------------------------------------------------------------

    def max_batches_held(self) -> int:
        """The most batches this input holds at once, its memory bound in batches.

        The FIFOQueue (``queue_capacity``), per device the StagingArea (``nr_stage + 1`` while a
        step swaps) and the batch the step is using, the receive thread's (the received frame and its copy
        waiting to enter a full queue), and per producer what its connection may hold: with direct
        receive the one batch its thread reads into (or holds, waiting for room in the queue); with
        libzmq its receive buffer (``rcvhwm``) plus the message libzmq is assembling from the TCP stream.
        """
        per_producer = self._core.receiver.held_per_producer
        return (self.queue_capacity + (self.nr_stage + 1 + 1) * len(self.devices) + 2
                + per_producer * len(self._core.pool.endpoints))

    def queue_size(self) -> int:
        """Batches in the FIFOQueue right now."""
        return self._feeder.size()

    def queue_occupancy(self) -> float:
        """Fraction of the FIFOQueue in use right now; near 0 means training waits for input."""
        return self.queue_size() / self.queue_capacity

    def write_summaries(self, step: int) -> None:
        """Write queue occupancy and counters as TensorBoard scalars to the default summary writer."""
        stats = self.stats
        tf.summary.scalar("stoker/queue_occupancy", self.queue_occupancy(), step=step)
        tf.summary.scalar("stoker/mean_queue_occupancy", stats.mean_queue_occupancy, step=step)
        tf.summary.scalar("stoker/batches_received", stats.batches, step=step)
        tf.summary.scalar("stoker/protocol_errors", stats.protocol_errors + stats.mismatched_batches, step=step)

