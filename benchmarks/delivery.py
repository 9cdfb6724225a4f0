"""What reaches this process from a producer: the receive loop the producer benchmarks share."""

from __future__ import annotations

import time
from typing import Callable

import zmq

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
