"""The trainer's FIFOQueue, one component per batch array, in TF2 eager mode or a tf.compat.v1 graph.

``EagerQueue`` runs enqueue ops directly; ``GraphQueue`` builds placeholders and
ops once and runs them in the user's Session (set before the first enqueue).
Both enqueue numpy arrays (the "copy to TF", once per byte, happens here, on the
receive thread) and close with or without cancelling pending enqueues.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from stoker.protocol.batch_spec import BatchSpec

from stoker.consumer.tf.tensor_import import TensorImporter


def make_fifo_queue(spec: BatchSpec, capacity: int, name: str) -> tf.queue.FIFOQueue:
    return tf.queue.FIFOQueue(capacity, [tf.as_dtype(a.dtype) for a in spec.arrays],
                              shapes=[list(a.shape) for a in spec.arrays], name=name)


class EagerQueue:
    """FIFOQueue operations in TF2 eager mode; arrays enter with one copy (``TensorImporter``)."""

    def __init__(self, queue: tf.queue.FIFOQueue) -> None:
        self.queue = queue
        self.importer = TensorImporter()

    def enqueue(self, arrays: Sequence[np.ndarray]) -> None:
        # The raw op: QueueBase.enqueue re-checks dtypes and opens name scopes in Python on every call
        # (~35 us per batch); the arrays were checked against the queue's spec on arrival.
        tf.raw_ops.QueueEnqueueV2(handle=self.queue.queue_ref, components=[self.importer.to_tensor(a) for a in arrays])

    def enqueue_owned(self, arrays: Sequence[np.ndarray]) -> None:
        """Arrays from ``self.importer.empty``, filled by the caller: they enter without a copy."""
        tf.raw_ops.QueueEnqueueV2(handle=self.queue.queue_ref, components=[self.importer.own(a) for a in arrays])

    def size(self) -> int:
        return int(self.queue.size())

    def close(self, cancel: bool) -> None:
        self.queue.close(cancel_pending_enqueues=cancel)


class GraphQueue:
    """FIFOQueue operations in a tf.compat.v1 graph, run with the user's Session."""

    def __init__(self, queue: tf.queue.FIFOQueue, spec: BatchSpec) -> None:
        v1 = tf.compat.v1
        self.queue = queue
        self.session: Any = None
        self.importer = TensorImporter()  # direct receive reads into its buffers
        self.placeholders = [v1.placeholder(tf.as_dtype(a.dtype), list(a.shape), name=f"stoker_{a.name}")
                             for a in spec.arrays]
        self.enqueue_op = queue.enqueue(self.placeholders)
        self.size_op = queue.size()
        self.close_op = queue.close(cancel_pending_enqueues=False)
        self.cancel_op = queue.close(cancel_pending_enqueues=True)

    def enqueue(self, arrays: Sequence[np.ndarray]) -> None:
        self.session.run(self.enqueue_op, feed_dict=dict(zip(self.placeholders, arrays)))

    enqueue_owned = enqueue  # arrays from self.importer.empty: feeding them copies, as any feed does

    def size(self) -> int:
        return int(self.session.run(self.size_op))

    def close(self, cancel: bool) -> None:
        self.session.run(self.cancel_op if cancel else self.close_op)
