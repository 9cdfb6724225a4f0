"""One producer worker process: read records, decode, augment into shared memory, hand off.

Runs in a child process started with the ``spawn`` method (no fork surprises:
LMDB and ZMQ handles are opened here, fresh). Each batch is decoded straight
into a free slot of the worker's shared buffer (``batch_slots``); the worker then
tells the daemon "slot S is ready" with the batch header, and the daemon sends
the slot's memory to the trainer. With no free slot the worker waits: that is
the backpressure, and it bounds memory. Bad records are logged with their key,
counted and skipped; the worker never dies of bad data. It exits when ``stop``
is set (checked between records and every 100 ms while waiting) or when its
parent dies (PR_SET_PDEATHSIG on Linux, plus a parent-pid check).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import zmq

from stoker.protocol import encode_batch

from .augment import DecodeError, decode_rgb, decode_train_crop, eval_transform, resize_flip_into
from .batch_slots import GRANT, HELLO, READY, SlotLayout, parse_slot, slot_frame
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
    slots: int = 3
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


class _SlotPool:
    """The slots the daemon has granted this worker; ``acquire`` waits for one, honouring ``stop``."""

    def __init__(self, sock: zmq.Socket, slots: int, stop: Any, parent_pid: int) -> None:
        self.sock, self.slots, self.stop, self.parent_pid = sock, slots, stop, parent_pid
        self.free: deque[int] = deque()

    def acquire(self) -> Optional[int]:
        """A slot this worker may write, or None once stopped or orphaned."""
        while not self.free:
            if self.stop.is_set() or os.getppid() != self.parent_pid:
                return None
            if self.sock.poll(100):
                message = self.sock.recv_multipart()
                if len(message) == 2 and message[0] == GRANT:
                    slot = parse_slot(message[1], self.slots)
                    if slot not in self.free:
                        self.free.append(slot)
        return self.free.popleft()


def run_worker(worker: int, config: WorkerConfig, stats: StageStats, stop: Any, parent_pid: int,
               buffer: Any, routing_id: bytes) -> None:
    """Process entry point. Returns when stopped; never raises on bad records.

    ``buffer`` is this worker's shared memory (``batch_slots.allocate``); ``routing_id``
    names this process to the daemon, fresh for every (re)start.
    """
    _die_with_parent()
    # The daemon owns shutdown: Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format)
    dataset = LmdbDataset(config.lmdb_path)
    records = config.shard.records(len(dataset))
    stream = worker_stream(records, config.seed, worker, config.workers, shuffle=True)
    train = config.mode == "train"
    size, batch_size = config.image_size, config.batch_size
    views = SlotLayout(batch_size, size, config.slots).views(buffer)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.endpoint)
    sock.send(HELLO)
    pool = _SlotPool(sock, config.slots, stop, parent_pid)

    def hand_off(slot: int, arrays: dict[str, np.ndarray], batch_no: int) -> None:
        """Tell the daemon ``slot`` holds a finished batch: only its header crosses the ipc socket."""
        header = encode_batch(arrays, producer=config.producer_id,
                              seq=batch_no * config.workers + worker, worker=worker)[0]
        sock.send_multipart([READY, slot_frame(slot), header])

    batch_no = 0
    made: list[dict[str, np.ndarray]] = []
    try:
        while not stop.is_set() and os.getppid() == parent_pid:
            t_wait = time.perf_counter()
            slot = pool.acquire()
            if slot is None:
                break
            t_wait = time.perf_counter() - t_wait
            arrays = views[slot]
            if config.repeat_batches and len(made) == config.repeat_batches:
                # Benchmark mode: re-send batches already made, as fast as the trainer takes them.
                for name, array in made[batch_no % len(made)].items():
                    np.copyto(arrays[name], array)
                hand_off(slot, arrays, batch_no)
                for name, value in (("send_s", t_wait), ("images", batch_size), ("batches", 1)):
                    stats.add(worker, name, value)
                batch_no += 1
                continue
            images, labels, indices, epochs = (arrays[k] for k in ("images", "labels", "index", "epoch"))
            rng = np.random.default_rng([config.seed, worker, batch_no])
            t_read = t_decode = t_augment = 0.0
            filled = 0
            while filled < batch_size and not stop.is_set():
                epoch, index = next(stream)
                t0 = time.perf_counter()
                try:
                    label, data = dataset.read(index)
                    t1 = time.perf_counter()
                    # train: only the random crop window is decoded, where the decoder can
                    pixels = decode_train_crop(data, rng, config.fast_dct) if train else decode_rgb(data, config.fast_dct)
                    t2 = time.perf_counter()
                except (RecordError, DecodeError) as exc:
                    stats.add(worker, "skipped", 1)
                    log.warning("skipping record %s: %s", record_key(index).decode(), exc)
                    continue
                if train:
                    resize_flip_into(pixels, size, rng, images[filled])
                else:
                    eval_transform(pixels, size, images[filled])
                t3 = time.perf_counter()
                t_read, t_decode, t_augment = t_read + t1 - t0, t_decode + t2 - t1, t_augment + t3 - t2
                labels[filled], indices[filled], epochs[filled] = label, index, epoch
                filled += 1
            if filled < batch_size:
                break
            t4 = time.perf_counter()
            if len(made) < config.repeat_batches:
                made.append({name: array.copy() for name, array in arrays.items()})
            hand_off(slot, arrays, batch_no)
            for name, value in (
                ("read_s", t_read), ("decode_s", t_decode), ("augment_s", t_augment),
                ("serialize_s", time.perf_counter() - t4), ("send_s", t_wait), ("images", batch_size), ("batches", 1),
            ):
                stats.add(worker, name, value)
            batch_no += 1
    finally:
        sock.close(linger=0)
        ctx.term()
        dataset.close()
