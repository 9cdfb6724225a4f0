"""One producer worker process: read records, decode, augment, batch, send.

Runs in a child process started with the ``spawn`` method (no fork surprises:
LMDB and ZMQ handles are opened here, fresh). It PUSHes finished batches to the
daemon's internal endpoint; a bounded send high-water mark makes it block when
the trainer is slow, so memory stays bounded. Bad records are logged with
their key, counted and skipped; the worker never dies of bad data. It exits
when ``stop`` is set (checked between records and every 100 ms while blocked
on a full pipe) or when its parent dies (PR_SET_PDEATHSIG on Linux, plus a
parent-pid check).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from stoker.protocol import encode_batch

from .augment import DecodeError, decode_rgb, eval_transform, train_transform
from .dataset_format import LmdbDataset, RecordError, record_key
from .logs import configure_logging
from .sharding import ShardSpec, worker_stream
from .stage_stats import StageStats

log = logging.getLogger("stoker.producer.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs; plain data so it crosses ``spawn`` safely."""

    lmdb_path: str
    endpoint: str
    producer_id: str
    shard: ShardSpec
    batch_size: int
    image_size: int
    mode: str
    seed: int
    workers: int
    sndhwm: int = 2
    log_level: int = logging.INFO
    log_format: str = "text"
    repeat_batches: int = 0
    fast_dct: bool = False


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def _send(sock: zmq.Socket, frames: list[Any], stop: Any, parent_pid: int) -> bool:
    """Send with backpressure, waking every 100 ms to honour ``stop``. False if stopped."""
    while not stop.is_set():
        if sock.poll(100, zmq.POLLOUT):
            sock.send_multipart(frames, copy=False)
            return True
        if os.getppid() != parent_pid:
            return False
    return False


def run_worker(worker: int, config: WorkerConfig, stats: StageStats, stop: Any, parent_pid: int) -> None:
    """Process entry point. Returns when stopped; never raises on bad records."""
    _die_with_parent()
    # The daemon owns shutdown: Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format)
    dataset = LmdbDataset(config.lmdb_path)
    records = config.shard.records(len(dataset))
    stream = worker_stream(records, config.seed, worker, config.workers, shuffle=True)
    train = config.mode == "train"
    size, batch_size = config.image_size, config.batch_size
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, config.sndhwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.endpoint)
    batch_no = 0
    made: list[dict[str, np.ndarray]] = []
    try:
        while not stop.is_set() and os.getppid() == parent_pid:
            if config.repeat_batches and len(made) == config.repeat_batches:
                # Benchmark mode: re-send batches already made, as fast as the pipe takes them.
                # The arrays are never written again, so handing them to ZMQ again is safe.
                frames = encode_batch(made[batch_no % len(made)], producer=config.producer_id,
                                      seq=batch_no * config.workers + worker, worker=worker)
                t5 = time.perf_counter()
                if not _send(sock, frames, stop, parent_pid):
                    break
                stats.add(worker, "send_s", time.perf_counter() - t5)
                stats.add(worker, "images", batch_size)
                stats.add(worker, "batches", 1)
                batch_no += 1
                continue
            # A fresh buffer per batch: ZMQ may still hold the previous one (copy=False).
            images = np.empty((batch_size, size, size, 3), np.uint8)
            labels = np.empty(batch_size, np.int32)
            indices = np.empty(batch_size, np.int64)
            epochs = np.empty(batch_size, np.int32)
            rng = np.random.default_rng([config.seed, worker, batch_no])
            t_read = t_decode = t_augment = 0.0
            filled = 0
            while filled < batch_size and not stop.is_set():
                epoch, index = next(stream)
                t0 = time.perf_counter()
                try:
                    label, data = dataset.read(index)
                    t1 = time.perf_counter()
                    rgb = decode_rgb(data, config.fast_dct)
                    t2 = time.perf_counter()
                except (RecordError, DecodeError) as exc:
                    stats.add(worker, "skipped", 1)
                    log.warning("skipping record %s: %s", record_key(index).decode(), exc)
                    continue
                if train:
                    train_transform(rgb, size, rng, images[filled])
                else:
                    eval_transform(rgb, size, images[filled])
                t3 = time.perf_counter()
                t_read, t_decode, t_augment = t_read + t1 - t0, t_decode + t2 - t1, t_augment + t3 - t2
                labels[filled], indices[filled], epochs[filled] = label, index, epoch
                filled += 1
            if filled < batch_size:
                break
            t4 = time.perf_counter()
            arrays = {"images": images, "labels": labels, "index": indices, "epoch": epochs}
            if len(made) < config.repeat_batches:
                made.append(arrays)
            frames = encode_batch(
                arrays,
                producer=config.producer_id,
                seq=batch_no * config.workers + worker,
                worker=worker,
            )
            t5 = time.perf_counter()
            if not _send(sock, frames, stop, parent_pid):
                break
            t6 = time.perf_counter()
            for name, value in (
                ("read_s", t_read), ("decode_s", t_decode), ("augment_s", t_augment),
                ("serialize_s", t5 - t4), ("send_s", t6 - t5), ("images", batch_size), ("batches", 1),
            ):
                stats.add(worker, name, value)
            batch_no += 1
    finally:
        sock.close(linger=0)
        ctx.term()
        dataset.close()
