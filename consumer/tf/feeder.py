"""The TensorFlow side of an input: FIFOQueue, one StagingArea per device, ``get()`` and ``as_dataset()``.

    receive core --put--> FIFOQueue ("copy to TF", off the step) --dequeue--> StagingArea per device --> step

``TFFeeder`` is the core's ``BatchSink``: ``put`` enqueues a batch's arrays (owned aligned
buffers without a copy, libzmq frames with one, ``tensor_import``) and blocks while the queue
is full; ``get()`` takes the batch staged at the previous step from the caller's device and
stages the next, so the host-to-device copy overlaps the step. Sockets are not its business.
In exact mode each batch has a last array, ``stoker_source``: when a step is given a batch,
``record_consumed`` reports its rows to that producer; padding rows are cut off; a batch
whose source is -1 is a terminator, the end of a finite run. ``input_error()`` says why the
input failed; ``get()`` raises it instead of TensorFlow's bare OutOfRangeError.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from stoker.protocol.batch_spec import BatchSpec

from stoker.consumer.tf.batch_tensors import BatchTensors, Selection, check_selection, select
from stoker.consumer.receive.errors import InputError, InputFinished
from stoker.consumer.receive.contract import SinkClosed
from stoker.consumer.tf.staging import StagingArea
from stoker.consumer.tf.fifo_queue import EagerQueue, GraphQueue, make_fifo_queue

ConsumedHook = Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]


class TFFeeder:
    """See the module doc. ``spec``: the batch arrays (exact mode: plus ``stoker_source`` last)."""

    def __init__(self, spec: BatchSpec, queue_spec: BatchSpec, capacity: int, devices: Sequence[str], nr_stage: int,
                 name: str, input_error: Callable[[], Optional[InputError]], finished_message: str,
                 record_consumed: Optional[ConsumedHook] = None, activate: Callable[[], None] = lambda: None) -> None:
        self.spec, self.queue_spec = spec, queue_spec
        self.capacity = capacity
        self.devices = list(devices)
        self.nr_stage = nr_stage
        self.eager = tf.executing_eagerly()
        self._input_error = input_error
        self._finished_message = finished_message
        self._record_consumed = record_consumed
        self._activate = activate
        self._unpacked = spec.pipeline_fields()
        self._prefilled = False
        self._ended = False
        self._combine_max = 1
        queue = make_fifo_queue(queue_spec, capacity, name)
        self.queue: EagerQueue | GraphQueue = EagerQueue(queue) if self.eager else GraphQueue(queue, queue_spec)
        self.exact = record_consumed is not None
        if self.exact:  # dequeuing from it raises OutOfRangeError: how get() ends a finite run at a terminator
            self._end_queue = tf.queue.FIFOQueue(1, [tf.int32], shapes=[[]], name=f"{name}_end")
            self.end_close_op = self._end_queue.close()
        dtypes = [tf.as_dtype(a.dtype) for a in queue_spec.arrays]
        self.stagings = [StagingArea(dtypes, d, capacity=nr_stage + 1, name=f"{name}_staging{i}")
                         for i, d in enumerate(self.devices)]

    # ---- BatchSink --------------------------------------------------------------------------------

    def empty(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.queue.importer.empty(dtype, shape)

    def put(self, arrays: Sequence[np.ndarray], owned: bool) -> None:
        try:
            if owned:
                self.queue.enqueue_owned(arrays)
            else:
                self.queue.enqueue(arrays)
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError, tf.errors.AbortedError):
            raise SinkClosed() from None

    def size(self) -> int:
        return self.queue.size()

    def end(self) -> None:
        """Let the last batches through the staging areas (terminators behind them), then close."""
        self._ended = True
        blank = [np.zeros(a.shape, a.dtype) for a in self.queue_spec.arrays]
        blank[-1][...] = -1  # no source: no records to report
        # What get() stages ahead of the last real batch, and (as_dataset(combine=k)) a whole group of k.
        try:
            for _ in range(self.nr_stage * len(self.stagings) + 2 * self._combine_max):
                self.queue.enqueue(blank)
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError, tf.errors.AbortedError):
            return
        self.queue.close(cancel=False)

    def close(self, cancel: bool) -> None:
        self.queue.close(cancel=cancel)

    # ---- the ways in ------------------------------------------------------------------------------

    def _error(self, exc: Exception) -> InputError:
        error = self._input_error()
        if error is not None:
            return error
        if self._ended:
            return InputFinished(self._finished_message)
        return InputError(str(exc))

    def named(self, tensors: Sequence[tf.Tensor], end_raises: bool = True) -> BatchTensors:
        """The batch by name; exact mode: rows reported consumed, padding cut off, and (``end_raises``)
        OutOfRangeError for a terminator, the end of a finite run."""
        by_name = {}
        for tensor, array in zip(tensors, self.spec.arrays):
            tensor.set_shape(array.shape)
            by_name[array.name] = tensor
        if self.exact:  # these rows are consumed now; padding rows are cut off
            # numpy_function, not py_function: no eager tensors made around the call; one cond for every array.
            mask = by_name["mask"]
            done = tf.numpy_function(self._consumed, [tensors[-1], by_name["epoch"], by_name["index"], mask],
                                     tf.int32, stateful=True, name="stoker_consumed")
            deps = [done]
            if end_raises:
                deps.append(tf.cond(tf.equal(tensors[-1][0], -1), self._end_queue.dequeue,
                                    lambda: tf.constant(0, tf.int32)))
            with tf.control_dependencies(deps):
                full = tf.reduce_all(mask)  # nearly always: then no copy at all
            names, values = list(by_name), list(by_name.values())
            kept = tf.cond(full, lambda: [tf.identity(t) for t in values],
                           lambda: [tf.boolean_mask(t, mask) for t in values])
            by_name = dict(zip(names, kept))
        return BatchTensors(by_name=by_name, unpacked=self._unpacked)

    def _consumed(self, source: np.ndarray, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> np.int32:
        assert self._record_consumed is not None
        self._record_consumed(int(source[0]), epochs, indices, mask)
        return np.int32(0)

    def get(self) -> BatchTensors:
        """This step's batch from the caller's replica's StagingArea, staging the next; see ZMQInput.get."""
        error = self._input_error()
        if error is not None:
            raise error
        replica = self._replica()
        self._activate()
        with tf.init_scope():
            self._prefill()
        if tf.executing_eagerly():
            try:
                return self._swap(replica)
            except (tf.errors.OutOfRangeError, tf.errors.CancelledError, tf.errors.InvalidArgumentError) as exc:
                raise self._error(exc) from exc
        return self._swap(replica)

    def _replica(self) -> int:
        """Which StagingArea the caller's replica reads: 0 with one device, else its replica id."""
        if len(self.stagings) == 1:
            return 0
        context = tf.distribute.get_replica_context()
        replica = None
        if context is not None and context.num_replicas_in_sync == len(self.stagings):
            replica = tf.get_static_value(context.replica_id_in_sync_group)
        if replica is None:
            raise ValueError(f"this ZMQInput stages on {len(self.stagings)} devices ({', '.join(self.devices)}): call "
                             "get() inside strategy.run(replica_fn) of a strategy over those devices, which tells "
                             "each replica's batch apart")
        return int(replica)

    def _swap(self, replica: int = 0) -> BatchTensors:
        staging = self.stagings[replica]
        # Name (and in exact mode report as consumed) this step's batch before staging the next: at the
        # end of a finite run the next dequeue waits until the producers have heard of this one.
        named = self.named(staging.get())
        staging.put(self.queue.queue.dequeue())
        return named

    def _prefill(self) -> None:
        if self._prefilled or not self.eager:
            return
        try:
            for staging in self.stagings:
                for _ in range(self.nr_stage):
                    staging.put(self.queue.queue.dequeue())
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError) as exc:
            raise self._error(exc) from exc
        self._prefilled = True

    def dequeue(self) -> BatchTensors:
        """Plain dequeue tensors (no staging), named as ``get()``'s."""
        if self.eager:
            self._activate()
        return self.named(self.queue.queue.dequeue())

    def as_dataset(self, x: Optional[Selection] = None, y: Optional[Selection] = None,
                   combine: int = 1) -> tf.data.Dataset:
        """An infinite ``tf.data.Dataset`` of ``(x, y)`` batches; see ZMQInput.as_dataset."""
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
        queue, named, spec, exact = self.queue.queue, self.named, self.queue_spec, self.exact

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
