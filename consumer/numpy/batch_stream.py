"""BatchStream: batches from Stoker producers as dicts of NumPy arrays, for JAX, PyTorch or any framework.

The same receive core as ``ZMQInput`` (direct ZMTP over tcp:// and ipc:// by default, libzmq for CurveZMQ,
exact mode with its state), feeding a bounded queue instead of TensorFlow; TensorFlow is
never imported. Iterate it::

    from stoker.consumer.numpy.batch_stream import BatchStream

    with BatchStream(["tcp://datahost:5555"]) as stream:       # learns the spec from the first batch
        for step, batch in zip(range(1000), stream):
            images, labels = batch["images"], batch["labels"]  # uint8 [B, H, W, 3], int32 [B]

Ownership: every batch is a dict of fresh, 64-byte-aligned, C-contiguous arrays that belong
to the caller. Stoker never reads or writes them again, so they may be kept, modified or
handed to a device transfer (``jax.device_put``) without a copy; each array is received
straight into its memory (direct receive) or copied into it once (libzmq path).

Memory: at most ``queue_capacity`` batches wait in the queue, plus one per producer being
received (direct; libzmq: ``rcvhwm + 1``) and the one the caller holds.

Exact mode (``exact=True``, producers ``--exact`` or ``--epochs N``): a batch's records count as
consumed when ``next()`` returns it; ``save_state()`` gives bytes to store with the model's
checkpoint and ``resume_state=`` / ``restore_state()`` (before the first ``next()``) continue
from them. Padding rows of a finite run's last batch are cut off; the iteration ends
(StopIteration) after the last batch of the last epoch.
``for epoch, batches in stream.epochs()`` takes one epoch at a time instead (a batch spanning two
epochs split, ranks of a job padded to equal steps: ``InputBase.epochs``, ``epochs/epoch_loop.py``).

Errors: the input's error (InputTimeoutError when no acceptable batch arrived for
``recv_timeout`` seconds, saying why; InputError for a certain misconfiguration) is raised by
``next()`` once the batches that arrived before it are consumed; InputClosedError after ``close()``.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

from stoker.protocol import DEFAULT_MAX_MESSAGE_BYTES
from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.epochs.held_rows import padding_arrays
from stoker.consumer.input_base import InputBase
from stoker.consumer.input_setup import InputOptions
from stoker.consumer.placement.local_producer import LocalProducer
from stoker.consumer.receive.options import SpecArg
from stoker.consumer.receive.queue_sink import QueueSink


class BatchStream(InputBase):
    """An iterator of ``{name: np.ndarray}`` batches from Stoker producers; see the module doc.

    Args (as ``ZMQInput``'s, defaults included): ``addresses``; ``batch_size``/``image_shape`` or
    ``spec`` to declare the batches (default: learned from the first batch); ``queue_capacity``
    (default 8 batches); ``recv_timeout`` (60 s); ``rcvhwm`` (4); ``max_message_bytes`` (512 MiB);
    ``curve`` keys; ``exact``, ``resume_state``, ``trainer_id``; ``receive`` (``"auto"``); ``discover_every``
    (5 s: names are re-resolved, so the stream follows a growing and shrinking producer pool); ``share``
    (``(rank, world)`` of an elastic pool's splits, exact mode); ``stall_after`` (10 s: a producer holding work
    that sends nothing new for this long is stuck, and an elastic pool gives its work to the others) and
    ``stall_limit`` (300 s: fixed shards, a producer stuck this long fails the input); ``producers_per_trainer``
    (None: read every address; ``k``: a partitioned pool, this trainer reads only its ``k`` of them by ``share``);
    ``local_producer`` (None; ``LocalProducer(data, workers, ...)``: a producer started on this host over ``ipc://``,
    niced, one more in the pool, stopped at ``close()``; the input then receives through libzmq).
    """

    def __init__(self, addresses: Sequence[str] | str, batch_size: Optional[int] = None,
                 image_shape: Optional[Sequence[int]] = None, spec: SpecArg = None, queue_capacity: int = 8,
                 recv_timeout: float = 60.0, rcvhwm: int = 4, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 curve: Optional[CurveClientKeys] = None, exact: bool = False, resume_state: Optional[bytes] = None,
                 trainer_id: Optional[str] = None, receive: str = "auto", discover_every: float = 5.0,
                 share: tuple[int, int] = (0, 1), stall_after: Optional[float] = 10.0,
                 stall_limit: Optional[float] = 300.0, producers_per_trainer: Optional[int] = None,
                 local_producer: Optional[LocalProducer] = None) -> None:
        options = InputOptions.from_arguments(locals())
        self._open_input(options.receive_options(), local_producer)
        self._open_sink(QueueSink(options.queue_capacity))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self._next_batch()

    def _padding(self, epoch: int) -> dict[str, np.ndarray]:
        return padding_arrays(self.spec, epoch)

    def queue_occupancy(self) -> float:
        """Fraction of the queue in use right now; near 0 means the consumer waits for input."""
        return self._sink.size() / self._sink.capacity

    def close(self) -> None:
        """Stop receiving and close the sockets, then stop any local producer; bounded (about 2 s, plus the local
        producer's ``stop_timeout`` if SIGTERM does not stop it). Idempotent."""
        self._stop_metrics()
        self._core.close()
        self._stop_local_producer()

    def __enter__(self) -> "BatchStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

