"""ZMQInput: batches from producer daemons into TensorFlow with every copy hidden.

    producers --PUSH/PULL--> receive thread --enqueue--> FIFOQueue --dequeue--> StagingArea --> step

One PULL socket connects to every producer address (producers bind; ZMQ
reconnects by itself, so producers may start before or after the trainer and
may come and go). A background thread receives each multipart message,
decodes it with ``stoker.protocol`` (zero-copy views of the frames), checks it
against the batch spec (declared, or learned from the first batch) and
enqueues its arrays into a ``tf.queue.FIFOQueue`` with one component per array:
the "copy to TF" happens there, off the training thread. ``get()`` takes the
batch staged at the previous step from a StagingArea on the training device
while staging the next one: the "copy to GPU" overlaps the step. Any pipeline's
arrays travel this way; ZMQInput never looks inside them.

Bad messages raise ProtocolError inside the thread; they are counted, logged
(rate-limited) and dropped, and receiving carries on. If no batch arrives for
``recv_timeout`` seconds the queue is closed: the training step fails with
InputTimeoutError naming the producer addresses instead of waiting forever.
``close()`` (or leaving the ``with`` block) cancels pending queue operations,
stops the threads and closes the socket within about a second.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import msgpack
import numpy as np
import tensorflow as tf
import zmq

from stoker.protocol import DEFAULT_MAX_MESSAGE_BYTES, DecodeLimits, ProtocolError, decode_batch
from stoker.protocol.batch_codec import is_valid_id
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.curve import CurveClientKeys
from stoker.protocol.input_state import InputState

from .batch_tensors import BatchTensors, Selection, check_selection, select
from .connections import ConnectionWatcher
from .direct_receive import DirectReceiver
from .errors import BatchMismatchError, InputClosedError, InputError, InputFinished, InputTimeoutError
from .exact_transport import ExactTransport
from .staging import StagingArea
from .tf_queue import EagerQueue, GraphQueue, make_fifo_queue
from .zmtp import tcp_address

log = logging.getLogger("stoker.consumer")

_POLL_MS = 100
_WAITING_LOG_EVERY_S = 10.0
_SAMPLE_EVERY_S = 0.05
_REJECT_LOG_EVERY_S = 10.0
_STATE_FORMAT = "stoker-zmqinput-state"


@dataclass
class InputStats:
    """Counters of one ZMQInput. ``snapshot()`` returns a consistent copy."""

    batches: int = 0
    bytes: int = 0
    protocol_errors: int = 0
    mismatched_batches: int = 0
    reconnects: int = 0
    connected_producers: int = 0
    connected_endpoints: tuple[str, ...] = ()
    handshake_failures: int = 0
    last_handshake_error: str = ""
    last_error: str = ""
    per_producer: dict[str, int] = field(default_factory=dict)
    samples_per_producer: dict[str, int] = field(default_factory=dict)
    #: producer -> stage (read, decode, augment, send: waiting to hand off) -> seconds its workers spent on what we received
    stage_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    occupancy_sum: float = 0.0
    occupancy_samples: int = 0

    @property
    def mean_queue_occupancy(self) -> float:
        """Time-sampled mean fraction of queue capacity in use (near 0: input-bound)."""
        return self.occupancy_sum / self.occupancy_samples if self.occupancy_samples else 0.0


class ZMQInput(tf.train.experimental.PythonState):
    """Feed a TensorFlow training step from Stoker producers, for any pipeline.

    Args:
        addresses: producer addresses, e.g. ``["tcp://hostA:5555", "tcp://hostB:5555"]``
            (a comma-separated string works too).
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
        receive: ``"libzmq"`` (default) or ``"direct"``: read each producer's stream ourselves
            (ZMTP over TCP, one thread per producer) straight into aligned memory TensorFlow then
            owns, saving the one copy a libzmq frame needs (docs/performance.md, section 9).
            Producers are unchanged. Needs ``tcp://`` addresses and a declared spec
            (``batch_size``, ``image_shape`` or ``spec``); not with ``curve`` or ``exact``.

    Three ways in (runnable versions in README.md)::

        with ZMQInput(["tcp://127.0.0.1:5555"], batch_size=64) as inp:
            @tf.function
            def step():                        # 1. custom TF2 loop
                images, labels = inp.get()     #    staged on the training device; inp.get()["index"] too
                ...
            model.fit(inp.as_dataset(), steps_per_epoch=100)   # 2. Keras: (images, labels)
        # 3. tf.compat.v1 graph: build inside a Graph, then inp.start(session); see README.

    Errors: InputTimeoutError when no acceptable batch arrives within ``recv_timeout`` (the
    message says whether producers were silent, sent other shapes, or failed the handshake),
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
        receive: str = "libzmq",
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise ValueError("ZMQInput needs at least one producer address, e.g. tcp://datahost:5555")
        if (batch_size is not None and batch_size < 1) or queue_capacity < 1 or nr_stage < 1 or recv_timeout <= 0:
            raise ValueError("batch_size, queue_capacity and nr_stage must be >= 1 and recv_timeout > 0")
        if spec is not None and (batch_size is not None or image_shape is not None):
            raise ValueError("give either spec or batch_size/image_shape, not both")
        self.addresses = list(addresses)
        self.queue_capacity = queue_capacity
        self.recv_timeout = recv_timeout
        self.nr_stage = nr_stage
        self.rcvhwm = rcvhwm
        self.name = name
        self.limits = DecodeLimits(max_message_bytes=max_message_bytes)
        self.eager = tf.executing_eagerly()
        if sum(x is not None for x in (device, devices, strategy)) > 1:
            raise ValueError("give one of device, devices or strategy")
        if strategy is not None:
            devices = list(strategy.extended.worker_devices)
        if devices is not None:
            if not devices:
                raise ValueError("devices must name at least one device, e.g. ['/GPU:0', '/GPU:1']")
            self.devices = list(devices)
        else:
            self.devices = [device or ("/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0")]
        self.device = self.devices[0]
        self._stats = InputStats()
        self._stats_lock = threading.Lock()
        self._error: Optional[InputError] = None
        self._stop = threading.Event()
        self._closed = False
        self._prefilled = False
        self._threads: list[threading.Thread] = []
        # Sockets are closed by whoever last may use them: close() once the receive thread has ended,
        # else that thread on its way out (closing a socket another thread is inside aborts libzmq).
        self._socket_owner = threading.Lock()
        self._receiver_ended = True  # until a receive thread starts
        self._sockets_abandoned = False
        self._sockets_closed = False
        self._metrics: Any = None
        # What went wrong since the last accepted batch, for the timeout's message.
        self._rejected_since_batch = 0
        self._handshake_failures_at_batch = 0
        self._last_reject_log = -_REJECT_LOG_EVERY_S
        self._waiting_logged_at = -_WAITING_LOG_EVERY_S
        self._unlogged_rejects = 0
        self._first: Optional[list[np.ndarray]] = None  # the batch a spec was learned from, enqueued first
        self.exact = exact
        self._combine_max = 1
        self._finished = False
        if (resume_state is not None or trainer_id is not None) and not exact:
            raise ValueError("resume_state and trainer_id belong to exact mode: pass exact=True (and start the "
                             "producers with --exact)")
        if trainer_id is not None and not is_valid_id(trainer_id):
            raise ValueError(f"trainer_id {trainer_id!r} must be 1-128 printable ASCII characters without spaces "
                             "(the producers refuse any other)")
        self.trainer_id, state = trainer_id or f"trainer-{secrets.token_hex(4)}", InputState()
        if resume_state:
            self.trainer_id, state = _parse_state(resume_state)
        self.receive = receive
        self._direct = receive == "direct"
        self._direct_errors: dict[str, str] = {}  # endpoint -> why it is not connected (under _stats_lock)
        self._delivering = 0  # direct receivers inside a (maybe blocked) enqueue (under _stats_lock)
        if receive not in ("libzmq", "direct"):
            raise ValueError(f"receive={receive!r}: choose 'libzmq' (default) or 'direct'")
        if self._direct:
            if curve is not None or exact:
                raise ValueError("receive='direct' speaks ZMTP without CurveZMQ and without exact mode: leave "
                                 "receive='libzmq' for curve keys or exact=True")
            if spec is None and batch_size is None and image_shape is None:
                raise ValueError("receive='direct' reads batches into memory sized by the spec: declare it "
                                 "(batch_size, image_shape or spec)")
            for address in self.addresses:
                tcp_address(address)

        self._ctx = zmq.Context()
        options = (
            (zmq.RCVHWM, rcvhwm),
            (zmq.MAXMSGSIZE, max_message_bytes),
            (zmq.LINGER, 0),
            (zmq.RECONNECT_IVL, 100),
            (zmq.RECONNECT_IVL_MAX, 1000),
            # Heartbeats find a dead peer (network cut, killed host) and force a reconnect.
            (zmq.HEARTBEAT_IVL, 1000),
            (zmq.HEARTBEAT_TIMEOUT, 5000),
        )
        self._exact: Optional[ExactTransport] = None
        if exact:
            try:
                self._exact = ExactTransport(self._ctx, self.addresses, self.trainer_id, state, rcvhwm, options, curve)
            except zmq.ZMQError as exc:
                self._ctx.destroy(linger=0)
                raise ValueError(f"cannot connect to the producer addresses {self.addresses}: {exc.strerror}; "
                                 "expected e.g. tcp://host:5555") from None
        self._sock = self._ctx.socket(zmq.PULL)
        for option, value in options:
            self._sock.setsockopt(option, value)
        if curve is not None:
            self._sock.curve_publickey = curve.public
            self._sock.curve_secretkey = curve.secret
            self._sock.curve_serverkey = curve.server_public
        try:  # the watcher connects, after its monitor runs: no handshake goes unseen
            self._watcher = ConnectionWatcher(self._sock, [] if exact or self._direct else self.addresses,
                                              curve=curve is not None)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            if self._exact is not None:
                self._exact.close()
            self._ctx.term()
            raise ValueError(f"cannot connect to the producer addresses {self.addresses}: {exc.strerror}; "
                             "expected e.g. tcp://host:5555") from None
        self._last_batch_at = time.monotonic()
        try:
            self.spec = self._resolve_spec(spec, batch_size, image_shape)
        except BaseException:
            self._close_sockets()  # no receive thread yet: this thread is the only user
            raise
        self.batch_size = self.spec.batch_size
        if "images" in self.spec:
            self.image_shape = tuple(self.spec["images"].shape[1:])
            self.batch_shape = list(self.spec["images"].shape)
        self._unpacked = self.spec.pipeline_fields()
        # Exact mode: each batch also carries which producer it came from, to report its records there.
        self._queue_spec = self.spec if not exact else BatchSpec.from_dict(
            {**{a.name: (a.dtype, a.shape) for a in self.spec.arrays}, "stoker_source": ("int32", [self.batch_size])})
        queue = make_fifo_queue(self._queue_spec, queue_capacity, name)
        self._queue: EagerQueue | GraphQueue = (EagerQueue(queue) if self.eager
                                                else GraphQueue(queue, self._queue_spec))
        if exact:  # dequeuing from it raises OutOfRangeError: how get() ends a finite run at a terminator
            self._end_queue = tf.queue.FIFOQueue(1, [tf.int32], shapes=[[]], name=f"{name}_end")
            self._end_close = self._end_queue.close()
        dtypes = [tf.as_dtype(a.dtype) for a in self._queue_spec.arrays]
        self._stagings = [StagingArea(dtypes, d, capacity=nr_stage + 1, name=f"{name}_staging{i}")
                          for i, d in enumerate(self.devices)]
        if self.eager:
            self.start()

    def _resolve_spec(self, spec: Any, batch_size: Optional[int], image_shape: Optional[Sequence[int]]) -> BatchSpec:
        if spec is not None:
            declared = spec if isinstance(spec, BatchSpec) else BatchSpec.from_dict(spec)
        elif batch_size is not None or image_shape is not None:
            declared = BatchSpec.classification(batch_size or 64, tuple(int(d) for d in (image_shape or (224, 224, 3))))
        elif self.exact:
            return self._describe_spec()
        else:
            return self._learn_spec()
        bookkeeping = [("index", "int64"), ("epoch", "int32")] + ([("mask", "bool")] if self.exact else [])
        extra = {n: d for n, d in bookkeeping if n not in declared}
        if extra:
            declared = BatchSpec.from_dict({**{a.name: (a.dtype, a.shape) for a in declared.arrays},
                                            **{n: (d, [declared.batch_size]) for n, d in extra.items()}})
        return declared

    def _describe_spec(self) -> BatchSpec:
        """Exact mode: ask the producers to describe their batches (bounded by recv_timeout); nothing is received."""
        assert self._exact is not None
        started = time.monotonic()
        while True:
            self._watch_connections()
            for i in self._exact.poll(_POLL_MS):
                try:
                    self._exact.receive(i)  # before a hello only status can come
                except ProtocolError as exc:
                    self._reject(exc)
            described = self._exact.spec()
            if described is not None:
                learned = BatchSpec.from_dict({n: (d, shape) for n, d, shape in described})
                log.info("producers describe their batches: %s", learned)
                return learned
            silent = time.monotonic() - started
            if silent > self.recv_timeout:
                raise InputTimeoutError(self._timeout_message(silent) + "; no batch spec was given, so the trainer "
                                        "asked the producers to describe their batches")

    def _learn_spec(self) -> BatchSpec:
        """Receive the first acceptable batch (bounded by recv_timeout) and take its spec."""
        started = time.monotonic()
        while True:
            self._watch_connections()
            silent = time.monotonic() - started
            if silent > self.recv_timeout:
                raise InputTimeoutError(self._timeout_message(silent) + "; no batch spec was given, so the "
                                        "trainer waited for a first batch to learn it from")
            if not self._sock.poll(_POLL_MS):
                continue
            try:
                batch = decode_batch(self._sock.recv_multipart(copy=False), self.limits)
                learned = BatchSpec.of(batch)
            except (ProtocolError, ValueError) as exc:
                self._reject(exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc)))
                continue
            log.info("learned the batch spec from producer %s: %s", batch.header.producer, learned)
            self._first = [batch.arrays[n] for n in learned.names]
            self._count(batch, self._first)
            return learned

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self, session: Any = None) -> None:
        """Start receiving. Eager mode starts in the constructor; graph mode needs the Session here.

        Exact mode receives nothing until the first ``get()``, ``as_dataset()`` or (graph mode) this
        call, so a checkpoint restored before then decides what is served.
        """
        if not self.eager:
            self._activate()
        if self._threads:
            return
        if not self.eager:
            if session is None:
                raise ValueError("in tf.compat.v1 graph mode call inp.start(session) once the Session exists")
            self._queue.session = session  # type: ignore[union-attr]
            if self.exact:
                session.run(self._end_close)
        self._last_batch_at = time.monotonic()
        loop = self._exact_receive_loop if self.exact else self._direct_receive_loop if self._direct \
            else self._receive_loop
        self._receiver_ended = False

        def receive() -> None:
            try:
                loop()
            finally:
                with self._socket_owner:
                    self._receiver_ended = True
                    if self._sockets_abandoned:
                        self._close_sockets()

        for target, name in ((receive, "stoker-receive"), (self._sample_loop, "stoker-occupancy")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop the threads, cancel pending queue operations, close the sockets. Idempotent, bounded (<= 4 s).

        The sockets are closed here once the receive thread has ended, else by that thread on its way out.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._error is None:
            self._error = InputClosedError(f"ZMQInput for {', '.join(self.addresses)} was closed")
        try:
            self._queue.close(cancel=True)
        except Exception:  # the v1 Session may already be closed
            pass
        for thread in self._threads:
            thread.join(2.0)
        if self._metrics is not None:
            self._metrics.close()
        with self._socket_owner:
            if not self._receiver_ended:
                # Still inside a libzmq call: it closes the sockets when it returns (within _POLL_MS).
                log.warning("the receive thread did not stop within 2 s; it closes its sockets when it does")
                self._sockets_abandoned = True
                return
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._sockets_closed:
            return
        self._sockets_closed = True
        self._watcher.close()
        self._sock.close(linger=0)
        if self._exact is not None:
            self._exact.close()
        self._ctx.term()

    def _activate(self) -> None:
        if self._exact is not None and not self._exact.active:
            self._exact.activate()  # the receive thread says hello on every connection from now on

    # ---- exact mode: the input state ------------------------------------------------------------

    def save_state(self) -> bytes:
        """Exact mode: this trainer's id and every record its steps consumed, as bytes for a checkpoint."""
        if self._exact is None:
            raise ValueError("save_state() is for exact mode: ZMQInput(..., exact=True) with producers --exact")
        return msgpack.packb({"format": _STATE_FORMAT, "trainer": self.trainer_id,
                              "state": self._exact.snapshot().to_wire()}, use_bin_type=True)

    def restore_state(self, data: bytes) -> None:
        """Exact mode: continue from ``save_state()`` bytes; before the first get() / as_dataset() / start()."""
        if self._exact is None:
            raise ValueError("restore_state() is for exact mode: ZMQInput(..., exact=True)")
        trainer_id, state = _parse_state(data)
        self._exact.restore(state)
        self.trainer_id = self._exact.trainer_id = trainer_id

    # tf.train.Checkpoint(input=inp): saved with the model, restored by checkpoint.restore()
    def serialize(self) -> bytes:
        return self.save_state() if self._exact is not None else b""

    def deserialize(self, string_value: bytes) -> None:
        if string_value:
            self.restore_state(string_value)

    def __enter__(self) -> "ZMQInput":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        failure = self._error if not isinstance(self._error, InputClosedError) else None
        self.close()
        # Inside tf.function the failure surfaces as OutOfRangeError (or autograph's StagingError
        # when it happens while tracing); re-raise it as the error that says what went wrong.
        if isinstance(exc, Exception) and failure is not None and exc is not failure:
            raise failure from exc

    # ---- the three ways in ------------------------------------------------------------------

    def _named(self, tensors: Sequence[tf.Tensor], end_raises: bool = True) -> BatchTensors:
        """The batch by name; exact mode: rows reported consumed, padding cut off, and (``end_raises``)
        OutOfRangeError for a terminator, the end of a finite run."""
        by_name = {}
        for tensor, array in zip(tensors, self.spec.arrays):
            tensor.set_shape(array.shape)
            by_name[array.name] = tensor
        if self._exact is not None:  # these rows are consumed now; padding rows are cut off
            done = tf.py_function(self._consumed, [tensors[-1], by_name["epoch"], by_name["index"], by_name["mask"]],
                                  tf.int32, name="stoker_consumed")
            deps = [done]
            if end_raises:
                deps.append(tf.cond(tf.equal(tensors[-1][0], -1), self._end_queue.dequeue,
                                    lambda: tf.constant(0, tf.int32)))
            with tf.control_dependencies(deps):
                mask = tf.identity(by_name["mask"])
            full = tf.reduce_all(mask)  # nearly always: then no copy at all
            by_name = {name: tf.cond(full, lambda t=t: tf.identity(t), lambda t=t: tf.boolean_mask(t, mask))
                       for name, t in by_name.items()}
        return BatchTensors(by_name=by_name, unpacked=self._unpacked)

    def _consumed(self, source: tf.Tensor, epochs: tf.Tensor, indices: tf.Tensor, mask: tf.Tensor) -> int:
        self._exact.record_consumed(int(source.numpy()[0]), epochs.numpy(), indices.numpy(),  # type: ignore[union-attr]
                                    mask.numpy())
        return 0

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
        self.raise_if_failed()
        replica = self._replica()
        self._activate()
        with tf.init_scope():
            self._prefill()
        if tf.executing_eagerly():
            try:
                return self._swap(replica)
            except (tf.errors.OutOfRangeError, tf.errors.CancelledError, tf.errors.InvalidArgumentError) as exc:
                raise (self._error or self._end(exc)) from exc
        return self._swap(replica)

    def _end(self, exc: Exception) -> InputError:
        if self._finished:
            return InputFinished(f"the producers at {', '.join(self.addresses)} finished their epochs: every record "
                                 "was delivered")
        return InputError(str(exc))

    def _replica(self) -> int:
        """Which StagingArea the caller's replica reads: 0 with one device, else its replica id."""
        if len(self._stagings) == 1:
            return 0
        context = tf.distribute.get_replica_context()
        replica = None
        if context is not None and context.num_replicas_in_sync == len(self._stagings):
            replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None:
            raise ValueError(f"this ZMQInput stages on {len(self._stagings)} devices ({', '.join(self.devices)}): call "
                             "get() inside strategy.run(replica_fn) of a strategy over those devices, which tells "
                             "each replica's batch apart")
        return int(replica)

    def _swap(self, replica: int = 0) -> BatchTensors:
        staging = self._stagings[replica]
        # Name (and in exact mode report as consumed) this step's batch before staging the next: at the
        # end of a finite run the next dequeue waits until the producers have heard of this one.
        named = self._named(staging.get())
        staging.put(self._queue.queue.dequeue())
        return named

    def _prefill(self) -> None:
        if self._prefilled or not self.eager:
            return
        try:
            for staging in self._stagings:
                for _ in range(self.nr_stage):
                    staging.put(self._queue.queue.dequeue())
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError) as exc:
            raise (self._error or self._end(exc)) from exc
        self._prefilled = True

    def dequeue(self) -> BatchTensors:
        """Plain dequeue tensors (no staging), named as ``get()``'s: for tf.compat.v1 graphs and tensorpack-style code."""
        if self.eager:
            self._activate()
        return self._named(self._queue.queue.dequeue())

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
        names = self.spec.names
        if x is None and y is None:
            if "images" not in names or "labels" not in names:
                raise ValueError(f"these batches have {', '.join(names)}: say which are inputs and which targets, "
                                 "e.g. as_dataset(x='images', y=('boxes', 'boxes_len', 'classes'))")
            x, y = "images", "labels"
        if x is None:
            raise ValueError("as_dataset needs x (the model's inputs) when y is given")
        if combine < 1:
            raise ValueError(f"combine must be >= 1, got {combine}")
        check_selection(x, names, "x")
        if y is not None and y != ():
            check_selection(y, names, "y")
        self._activate()
        self._combine_max = max(self._combine_max, combine)
        queue, named, spec = self._queue.queue, self._named, self._queue_spec
        exact = self._exact is not None

        def take(_: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
            """The next element and whether it is the end (exact mode: nothing but terminators)."""
            if combine == 1:
                tensors = queue.dequeue()
                parts = [tensors]
            else:
                stacked = queue.dequeue_many(combine)  # [combine, B, ...] per array
                parts = [[t[j] for t in stacked] for j in range(combine)]
            end = tf.reduce_all(tf.stack([p[-1][0] < 0 for p in parts])) if exact else tf.constant(False)
            if combine == 1:
                return named(parts[0], end_raises=False).as_dict(), end
            if not exact:  # [combine, B, ...] -> [combine * B, ...]
                return {a.name: tf.reshape(t, [combine * a.shape[0], *a.shape[1:]])
                        for t, a in zip(stacked, spec.arrays)}, end
            named_parts = [named(p, end_raises=False).as_dict() for p in parts]  # each reports to its own producer
            return {n: tf.concat([p[n] for p in named_parts], 0) for n in named_parts[0]}, end

        def pick(batch: dict[str, tf.Tensor], end: tf.Tensor) -> Any:
            return select(batch, x) if y is None or y == () else (select(batch, x), select(batch, y))

        dataset = tf.data.Dataset.from_tensors(0).repeat().map(take, num_parallel_calls=1)
        if exact:  # a finite run ends at the terminators; a batch whose records all failed has no rows: skip it
            first = self.spec.names[0]
            dataset = dataset.take_while(lambda batch, end: tf.logical_not(end))
            dataset = dataset.filter(lambda batch, end: tf.shape(batch[first])[0] > 0)
        return dataset.map(pick, num_parallel_calls=1)

    def keras_callback(self, log_every: int = 50, logdir: Optional[str] = None) -> "tf.keras.callbacks.Callback":
        """A Keras callback: occupancy log line/TensorBoard scalar every ``log_every`` batches; raises input errors."""
        from .keras_callback import ZMQInputCallback

        return ZMQInputCallback(self, log_every=log_every, logdir=logdir)

    # ---- what a user watches ----------------------------------------------------------------

    def max_batches_held(self) -> int:
        """The most batches this input holds at once, its memory bound in batches.

        The FIFOQueue (``queue_capacity``), per device the StagingArea (``nr_stage + 1`` while a
        step swaps) and the batch the step is using, the receive thread's (the received frame and its copy
        waiting to enter a full queue), and per producer ZMQ's receive buffer (``rcvhwm``) plus
        the message libzmq is assembling from the TCP stream; with ``receive="direct"``, per
        producer the one batch its thread reads into (or holds, waiting for room in the queue).
        """
        per_producer = 1 if self._direct else self.rcvhwm + 1
        return (self.queue_capacity + (self.nr_stage + 1 + 1) * len(self._stagings) + 2
                + per_producer * len(self.addresses))

    def queue_size(self) -> int:
        """Batches in the FIFOQueue right now."""
        return self._queue.size()

    def queue_occupancy(self) -> float:
        """Fraction of the FIFOQueue in use right now; near 0 means training waits for input."""
        return self.queue_size() / self.queue_capacity

    @property
    def stats(self) -> InputStats:
        with self._stats_lock:
            return replace(self._stats, per_producer=dict(self._stats.per_producer),
                           samples_per_producer=dict(self._stats.samples_per_producer),
                           stage_seconds={p: dict(s) for p, s in self._stats.stage_seconds.items()})

    def write_summaries(self, step: int) -> None:
        """Write queue occupancy and counters as TensorBoard scalars to the default summary writer."""
        stats = self.stats
        tf.summary.scalar("stoker/queue_occupancy", self.queue_occupancy(), step=step)
        tf.summary.scalar("stoker/mean_queue_occupancy", stats.mean_queue_occupancy, step=step)
        tf.summary.scalar("stoker/batches_received", stats.batches, step=step)
        tf.summary.scalar("stoker/protocol_errors", stats.protocol_errors + stats.mismatched_batches, step=step)

    def serve_metrics(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve Prometheus metrics on ``http://addr:port/metrics`` until close(); returns the port (0: any free)."""
        from stoker.protocol.metrics_server import MetricsServer

        from .metrics import ZMQInputCollector

        self._metrics = MetricsServer(port, ZMQInputCollector(self), addr)
        return self._metrics.port

    def raise_if_failed(self) -> None:
        """Raise the input's error (timeout, closed) if it has one."""
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> Optional[InputError]:
        return self._error

    @property
    def finished(self) -> bool:
        """Exact mode, a finite run: every producer finished its epochs (the input ends after the last batch)."""
        return self._finished

    # ---- background threads -----------------------------------------------------------------

    def _count(self, batch: Any, arrays: Sequence[np.ndarray]) -> None:
        producer = batch.header.producer
        # Real samples: an exact run's last batch is padded (mask); otherwise every row. Also called while the
        # spec is still being learned, so the batch's own rows count, not self.batch_size.
        samples = int(batch["mask"].sum()) if "mask" in batch.arrays else len(arrays[0]) if arrays else 0
        with self._stats_lock:
            stats = self._stats
            stats.batches += 1
            stats.bytes += sum(a.nbytes for a in arrays)
            stats.per_producer[producer] = stats.per_producer.get(producer, 0) + 1
            stats.samples_per_producer[producer] = stats.samples_per_producer.get(producer, 0) + samples
            if batch.header.stages:
                stages = stats.stage_seconds.setdefault(producer, {})
                for name, seconds in batch.header.stages.items():
                    stages[name] = stages.get(name, 0.0) + seconds

    def _reject(self, exc: ProtocolError) -> None:
        with self._stats_lock:  # also from several direct receivers at once
            if isinstance(exc, BatchMismatchError):
                self._stats.mismatched_batches += 1
            else:
                self._stats.protocol_errors += 1
            count = self._stats.protocol_errors + self._stats.mismatched_batches
            self._stats.last_error = str(exc)
            self._rejected_since_batch += 1
            self._unlogged_rejects += 1
            now = time.monotonic()
            # The first few one by one, then one line per interval: bad traffic must not flood the log.
            log_now = count <= 3 or now - self._last_reject_log >= _REJECT_LOG_EVERY_S
            if log_now:
                unlogged, self._last_reject_log, self._unlogged_rejects = self._unlogged_rejects, now, 0
        if log_now:
            log.warning("rejected message #%d (%d since the last warning): %s", count, unlogged, exc)

    def _watch_connections(self) -> None:
        if self._exact is not None:
            changed = self._exact.watch()
            connected, (failures, _, reason) = self._exact.connected(), self._exact.failures()
            reconnects = sum(w.reconnects for w in self._exact.watchers)
        else:
            changed = self._watcher.poll()
            connected, failures, reason = self._watcher.connected, self._watcher.failures.count, \
                self._watcher.failures.reason
            reconnects = self._watcher.reconnects
        if changed:
            with self._stats_lock:
                self._stats.connected_producers = len(connected)
                self._stats.connected_endpoints = tuple(sorted(connected))
                self._stats.handshake_failures = failures
                self._stats.last_handshake_error = reason
                self._stats.reconnects = reconnects

    def _failures(self) -> tuple[int, str, str]:
        if self._exact is not None:
            return self._exact.failures()
        f = self._watcher.failures
        return f.count, f.endpoint, f.reason

    def _timeout_message(self, silent: float) -> str:
        """Why no acceptable batch arrived: rejected batches, failed handshakes, or silence."""
        message = (f"no acceptable batch from any producer at {', '.join(self.addresses)} for {silent:.0f} s "
                   f"(recv_timeout={self.recv_timeout:g})")
        causes = []
        if self._rejected_since_batch:
            causes.append(f"{self._rejected_since_batch} message(s) arrived and were rejected, the last one because: "
                          f"{self.stats.last_error}")
        count, endpoint, reason = self._failures()
        handshakes = count - self._handshake_failures_at_batch
        if handshakes:
            causes.append(f"{handshakes} connection handshake(s) failed, the last with {endpoint}: {reason}")
        with self._stats_lock:
            direct_errors = sorted(self._direct_errors.items())
        for endpoint, reason in direct_errors:
            causes.append(f"cannot receive from {endpoint}: {reason}")
        if not causes:
            causes.append("nothing arrived: check the producers run (`stoker produce`) and that this host can reach "
                          "those addresses")
        return message + "; " + "; ".join(causes)

    def _receive_loop(self) -> None:
        sock, spec = self._sock, self.spec
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._queue.enqueue(first)
            while not self._stop.is_set():
                self._watch_connections()
                # Checked on every turn, not only when the socket is idle: a stream of rejected
                # messages (a misconfigured producer, a wrong peer) must not keep the step waiting.
                silent = time.monotonic() - self._last_batch_at
                if silent > self.recv_timeout:
                    self._fail(InputTimeoutError(self._timeout_message(silent)))
                    return
                try:  # receive first, poll only when nothing waits: one libzmq call per batch under load
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    sock.poll(_POLL_MS)
                    continue
                except zmq.ZMQError as exc:  # e.g. a frame over MAXMSGSIZE drops the connection
                    self._reject(ProtocolError(f"receive failed: {exc}"))
                    continue
                try:
                    batch = decode_batch(frames, self.limits)
                    arrays = spec.check(batch)
                except ProtocolError as exc:
                    self._reject(exc)
                    continue
                self._rejected_since_batch = 0
                self._handshake_failures_at_batch = self._watcher.failures.count
                self._queue.enqueue(arrays)  # may block on a full queue: that is not silence from the producers
                self._last_batch_at = time.monotonic()
                self._count(batch, arrays)
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError, tf.errors.AbortedError):
            pass  # the queue was closed: close() or a timeout
        except Exception as exc:  # never die silently: surface it to the training step
            log.exception("receive thread failed")
            self._fail(InputError(f"receive thread failed: {exc!r}"))

    def _direct_receive_loop(self) -> None:
        """receive='direct': a DirectReceiver thread per producer; this thread watches for silence."""
        def stopped() -> bool:
            return self._stop.is_set() or self._error is not None

        receivers = [DirectReceiver(address, self.spec, self.limits, self._queue.importer.empty, self._deliver,
                                    self._reject, stopped, self._direct_connection, poll_s=_POLL_MS / 1000)
                     for address in self.addresses]
        threads = [threading.Thread(target=self._run_direct, args=(r,), name=f"stoker-receive-{i}", daemon=True)
                   for i, r in enumerate(receivers)]
        for thread in threads:
            thread.start()
        try:
            while not stopped():
                with self._stats_lock:
                    if self._delivering:  # waiting for room in a full queue is not silence from the producers
                        self._last_batch_at = time.monotonic()
                silent = time.monotonic() - self._last_batch_at
                if silent > self.recv_timeout:
                    self._fail(InputTimeoutError(self._timeout_message(silent)))
                    return
                self._stop.wait(_POLL_MS / 1000)
        except Exception as exc:  # never die silently: surface it to the training step
            log.exception("direct receive failed")
            self._fail(InputError(f"direct receive failed: {exc!r}"))
        finally:
            deadline = time.monotonic() + 1.5  # readers notice a stop within _POLL_MS; close() waits 2 s for us
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            lingering = [t.name for t in threads if t.is_alive()]
            if lingering:
                log.warning("direct receive threads still running after the stop: %s", ", ".join(lingering))

    def _run_direct(self, receiver: DirectReceiver) -> None:
        try:
            receiver.run()
        except Exception as exc:  # never die silently: surface it to the training step
            log.exception("receive thread for %s failed", receiver.endpoint)
            self._fail(InputError(f"receive thread for {receiver.endpoint} failed: {exc!r}"))

    def _deliver(self, batch: Any, arrays: list[np.ndarray]) -> None:
        """A direct receiver's good batch: into the queue without a copy (may block on a full queue)."""
        with self._stats_lock:
            self._rejected_since_batch = 0
            self._delivering += 1
        try:
            self._queue.enqueue_owned(arrays)
        finally:
            with self._stats_lock:
                self._delivering -= 1
        self._last_batch_at = time.monotonic()
        self._count(batch, arrays)

    def _direct_connection(self, endpoint: str, connected: bool, reason: str, handshake_failed: bool) -> None:
        with self._stats_lock:
            if handshake_failed:
                self._stats.handshake_failures += 1
                self._stats.last_handshake_error = f"{endpoint}: {reason}"
            endpoints = set(self._stats.connected_endpoints)
            if connected:
                endpoints.add(endpoint)
                self._direct_errors.pop(endpoint, None)
            else:
                if endpoint in endpoints:
                    self._stats.reconnects += 1
                    log.warning("lost the connection to %s: %s", endpoint, reason)
                endpoints.discard(endpoint)
                self._direct_errors[endpoint] = reason
            self._stats.connected_endpoints = tuple(sorted(endpoints))
            self._stats.connected_producers = len(endpoints)

    def _exact_receive_loop(self) -> None:
        """Exact mode: receive only while the queue has room (no blocking, so heartbeats keep going)."""
        transport, spec = self._exact, self.spec
        assert transport is not None
        try:
            while not self._stop.is_set():
                self._watch_connections()
                transport.flush()
                if transport.finished:
                    self._finish()
                    return
                now = time.monotonic()
                queued = self._queue.size() if transport.active else 0
                if not transport.active or queued > 0:
                    self._last_batch_at = now  # the step is not waiting for data: not silence
                if not transport.active or queued >= self.queue_capacity:
                    self._stop.wait(0.02)
                    continue
                silent = now - self._last_batch_at
                if silent > self.recv_timeout:
                    self._fail(InputTimeoutError(self._timeout_message(silent)))
                    return
                for i in transport.poll(_POLL_MS):
                    try:
                        frames = transport.receive(i)
                        if frames is None:  # a status: the producer is alive, perhaps waiting for steps to report
                            self._last_batch_at = time.monotonic()
                            self._log_waiting(transport.status[i])
                            continue
                        batch = decode_batch(frames, self.limits)
                        if not transport.accept(i, batch.header.stream, batch.header.session):
                            continue  # sent before our latest hello: its records are served again
                        arrays = spec.check(batch)
                    except ProtocolError as exc:
                        self._reject(exc)
                        continue
                    except zmq.ZMQError as exc:
                        self._reject(ProtocolError(f"receive failed: {exc}"))
                        continue
                    self._rejected_since_batch = 0
                    self._handshake_failures_at_batch = transport.failures()[0]
                    self._queue.enqueue([*arrays, np.full(self.batch_size, i, np.int32)])
                    self._last_batch_at = time.monotonic()
                    transport.queued(i, batch["epoch"], batch["index"], batch["mask"])
                    self._count(batch, arrays)
                    if self._queue.size() >= self.queue_capacity:
                        break
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError, tf.errors.AbortedError):
            pass  # the queue was closed: close() or a timeout
        except Exception as exc:  # never die silently: surface it to the training step
            log.exception("receive thread failed")
            self._fail(InputError(f"receive thread failed: {exc!r}"))

    def _log_waiting(self, status: Any) -> None:
        """Say (every 10 s) that a producer waits for more trainers: a synchronous job waits for all of them."""
        now = time.monotonic()
        if status is None or status.waiting <= 0 or now - self._waiting_logged_at < _WAITING_LOG_EVERY_S:
            return
        self._waiting_logged_at = now
        log.warning("producer %s serves nothing until %d more trainer(s) join (it runs --min-trainers); "
                    "start the other trainers, or the producers with a smaller --min-trainers", status.producer,
                    status.waiting)

    def _finish(self) -> None:
        """Every producer finished: let the last batches through the staging areas, then end the input."""
        self._finished = True
        blank = [np.zeros(a.shape, a.dtype) for a in self._queue_spec.arrays]
        blank[-1][...] = -1  # no source: no records to report
        # What get() stages ahead of the last real batch, and (as_dataset(combine=k)) a whole group of k.
        for _ in range(self.nr_stage * len(self._stagings) + 2 * self._combine_max):
            self._queue.enqueue(blank)
        log.info("every producer finished its epochs: the input ends after the last batch")
        self._queue.close(cancel=False)

    def _fail(self, error: InputError) -> None:
        if self._error is None:
            self._error = error
            log.error("%s", error)
        try:
            self._queue.close(cancel=False)  # let the step drain what is queued, then fail
        except Exception:
            pass

    def _sample_loop(self) -> None:
        while not self._stop.wait(_SAMPLE_EVERY_S):
            try:
                size = self._queue.size()
            except Exception:
                return
            with self._stats_lock:
                self._stats.occupancy_sum += size / self.queue_capacity
                self._stats.occupancy_samples += 1


def _parse_state(data: bytes) -> tuple[str, InputState]:
    """``(trainer id, input state)`` from ``save_state()`` bytes; ValueError naming what is wrong."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not a ZMQInput state: invalid msgpack ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != _STATE_FORMAT or not isinstance(body.get("trainer"), str):
        raise ValueError(f"not a ZMQInput state (format {_STATE_FORMAT!r} and a trainer id expected)")
    return body["trainer"], InputState.from_wire(body.get("state"))
