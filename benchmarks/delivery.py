"""What reaches this process from producers: the receive loops the benchmarks share.

- ``delivered_rate``: one producer's batches received and decoded here (the producer benchmarks);
- ``producer_delivery``: a ``stoker produce`` daemon started for it, its delivered rate and the
  cores its workers, its daemon and this process used meanwhile;
- ``bare_receive``: a bare pyzmq PULL loop over any producers (the trainer's ceiling), ``copy``
  adding one copy of each array (the one-copy ceiling);
- ``zmq_input_receive``: ``ZMQInput`` feeding a ``tf.function`` step that only takes each batch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import zmq

from harness import launch_producer, own_cpu_seconds, producer_flags, producers_cpu_now
from stoker.producer.process import ProducerProcess
from stoker.protocol import Batch, decode_batch


def delivered_rate(producer: ProducerProcess, warmup: int, batches: int, check: Callable[[Batch], None],
                   on_clock_start: Callable[[], None] = lambda: None) -> float:
    """Samples/s received and decoded here over ``batches`` batches after ``warmup`` (>= 1) batches.

    ``check`` sees every batch; ``on_clock_start`` runs when timing starts. RuntimeError (with the
    producer's log tail) if nothing arrives for 120 s.
    """
    if warmup < 1 or batches < 1:
        raise ValueError("warmup and batches must be >= 1: the clock starts at the last warm-up batch")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 4)
    sock.connect(producer.endpoint)
    samples = 0
    try:
        for i in range(warmup + batches):
            if not sock.poll(120_000):
                raise RuntimeError("producer sent nothing for 120 s:\n" + producer.log_text()[-2000:])
            batch = decode_batch(sock.recv_multipart(copy=False))
            check(batch)
            if i == warmup - 1:
                on_clock_start()
                t0 = time.perf_counter()
            elif i >= warmup:
                samples += len(batch["index"])
        return samples / (time.perf_counter() - t0)
    finally:
        sock.close(0)
        ctx.term()


def producer_delivery(lmdb_path: Path, workers: int, batch: int, size: int, warmup: int,
                      batches: int) -> tuple[float, dict[str, float]]:
    """Images/s that reach this process from a `stoker produce` daemon with ``workers`` workers, and the
    cores each part used meanwhile: ``workers``, ``daemon``, ``receiver`` (this process)."""

    def check(decoded) -> None:
        assert decoded["images"].shape == (batch, size, size, 3)

    with launch_producer(lmdb_path, producer_flags(batch, size, workers, seed=0)) as producer:
        start = {}

        def clock_start() -> None:
            start["t"], start["cpu"] = time.perf_counter(), producers_cpu_now([producer])

        rate = delivered_rate(producer, warmup, batches, check, on_clock_start=clock_start)
        seconds = time.perf_counter() - start["t"]
        used = producers_cpu_now([producer]) - start["cpu"]
        return rate, {"workers": used.workers / seconds, "daemon": used.daemons / seconds,
                      "receiver": used.own / seconds}


def bare_receive(endpoints: list[str], warmup: int, batches: int, copy: bool = False) -> tuple[float, float, float]:
    """(images/s, bytes/s, cpu s per GB) of a bare receive loop (``copy``: plus one copy of each array)."""
    import numpy as np

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 4)
    for e in endpoints:
        sock.connect(e)
    try:
        images = nbytes = 0
        buffers: dict[str, np.ndarray] = {}
        for i in range(warmup + batches):
            if not sock.poll(60_000):
                raise RuntimeError("no batch for 60 s")
            batch = decode_batch(sock.recv_multipart(copy=False))
            if copy:
                for name, array in batch.arrays.items():
                    if name not in buffers:
                        buffers[name] = np.empty_like(array)
                    np.copyto(buffers[name], array)
            if i == warmup - 1:
                t0, c0 = time.perf_counter(), own_cpu_seconds()
            elif i >= warmup:
                images += len(batch["labels"])
                nbytes += sum(a.nbytes for a in batch.arrays.values())
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - c0
        return images / seconds, nbytes / seconds, cpu / (nbytes / 1e9)
    finally:
        sock.close(0)
        ctx.term()


def zmq_input_receive(endpoints: list[str], batch: int, size: int, warmup: int, batches: int,
                      receive: str | None = "libzmq", convert: bool = False) -> tuple[float, float, float]:
    """(images/s, bytes/s, cpu s per GB) of ZMQInput feeding a step that only takes each batch.

    ``receive``: ZMQInput's ``receive=`` (None: its default path, no ``receive=`` argument given);
    ``convert``: enqueue with ``tf.convert_to_tensor`` as before ``TensorImporter`` (baseline).
    """
    from stoker.consumer.tf.fifo_queue import EagerQueue

    importer_enqueue = EagerQueue.enqueue
    if convert:
        EagerQueue.enqueue = lambda self, arrays: self.queue.enqueue(list(arrays))  # type: ignore[method-assign]
    try:
        return _zmq_input_step_rate(endpoints, batch, size, warmup, batches, receive)
    finally:
        EagerQueue.enqueue = importer_enqueue  # type: ignore[method-assign]


def _zmq_input_step_rate(endpoints: list[str], batch: int, size: int, warmup: int, batches: int,
                         receive: str | None) -> tuple[float, float, float]:
    import tensorflow as tf

    from stoker.consumer import ZMQInput

    choice = {} if receive is None else {"receive": receive}
    with ZMQInput(endpoints, batch_size=batch, image_shape=(size, size, 3), recv_timeout=60, **choice) as inp:
        @tf.function
        def step():
            images, labels = inp.get()
            return tf.shape(images)[0]

        for _ in range(warmup):
            int(step())
        t0, c0, images = time.perf_counter(), own_cpu_seconds(), 0
        for _ in range(batches):
            images += int(step())
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - c0
        nbytes = images * (size * size * 3 + 4 + 8 + 4)  # pixels, label, index, epoch per sample
        return images / seconds, nbytes / seconds, cpu / (nbytes / 1e9)


def torch_input_receive(endpoints: list[str], batch: int, size: int, warmup: int,
                        batches: int) -> tuple[float, float, float]:
    """(images/s, bytes/s, cpu s per GB) of TorchInput with default arguments (direct receive into tensors, the
    CPU device) handing each batch to a loop that only takes it."""
    from stoker.consumer import TorchInput

    with TorchInput(endpoints, batch_size=batch, image_shape=(size, size, 3), recv_timeout=60) as inp:
        batches_in = iter(inp)
        for _ in range(warmup):
            next(batches_in)
        t0, c0, images = time.perf_counter(), own_cpu_seconds(), 0
        for _ in range(batches):
            images += len(next(batches_in)["labels"])
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - c0
        nbytes = images * (size * size * 3 + 4 + 8 + 4)  # pixels, label, index, epoch per sample
        return images / seconds, nbytes / seconds, cpu / (nbytes / 1e9)
