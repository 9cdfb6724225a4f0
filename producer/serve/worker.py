"""One producer worker process: read records, run the pipeline into shared memory, hand off.

Runs in a child process started with the ``spawn`` method (no fork surprises:
LMDB and ZMQ handles are opened here, fresh; the pipeline is built here from its
reference, so user code is imported in the worker). Each sample is written
straight into a free slot of the worker's shared buffer (``batch_slots``) by a
``BatchMaker`` (batch_maker.py: what goes into a batch); this module is the
process around it and its talk with the daemon: the worker tells the daemon
"slot S is ready" with the batch header, and the daemon sends the slot's memory
to the trainer. With no free slot the worker waits: that is the backpressure,
and it bounds memory.

Bad records and bad samples (corrupt record, undecodable image, a pipeline
function that raises or returns the wrong dtype or shape) are skipped, counted
and logged with their key (the first ten one by one, then a summary every
10 s): the worker never dies of bad data or user code. It exits when ``stop``
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
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import zmq

from stoker.protocol import encode_batch

from stoker.producer.serve.batch_maker import BatchMaker
from stoker.producer.serve.batch_slots import GRANT, HELLO, READY, SlotLayout, decode_work, parse_slot, slot_frame
from stoker.producer.dataset.sources import RemoteOptions, open_dataset
from stoker.producer.dataset.sources.record_source import source_kind, source_label
from stoker.producer.serve.logs import configure_logging
from stoker.producer.pipeline import load_pipeline
from stoker.producer.measure.stage_stats import StageStats, watch_storage, with_fetch
from stoker.producer.supervision.worker_progress import WorkerProgress

log = logging.getLogger("stoker.producer.serve.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs; plain data so it crosses ``spawn`` safely."""

    lmdb_path: str
    endpoint: str
    producer_id: str
    stream: str  # the daemon's stream key: which records, in which order (``StreamKey``)
    batch_size: int
    seed: int
    workers: int
    pipeline: str = "imagenet"
    pipeline_args: tuple[tuple[str, str], ...] = ()
    pipeline_standard: tuple[tuple[str, Any], ...] = ()
    slots: int = 3
    log_level: int = logging.INFO
    log_format: str = "text"
    repeat_batches: int = 0
    layout_arrays: tuple = field(default=())
    exact: bool = False  # the daemon says which records go into each batch (with each slot grant)
    remote: RemoteOptions = RemoteOptions()  # a dataset in object storage: how to reach it and cache its shards


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


class _SlotPool:
    """The slots the daemon has granted this worker; ``acquire`` waits for one, honouring ``stop``.

    In exact mode each grant carries the records to make (``work``); otherwise it is None.
    """

    def __init__(self, sock: zmq.Socket, slots: int, stop: Any, parent_pid: int, batch_size: int) -> None:
        self.sock, self.slots, self.stop, self.parent_pid = sock, slots, stop, parent_pid
        self.batch_size = batch_size
        self.free: deque[tuple[int, Optional[list[tuple[int, int]]]]] = deque()

    def acquire(self) -> Optional[tuple[int, Optional[list[tuple[int, int]]]]]:
        """``(slot, work)`` this worker may write, or None once stopped or orphaned."""
        while not self.free:
            if self.stop.is_set() or os.getppid() != self.parent_pid:
                return None
            if self.sock.poll(100):
                message = self.sock.recv_multipart()
                if len(message) in (2, 3) and message[0] == GRANT:
                    slot = parse_slot(message[1], self.slots)
                    work = decode_work(message[2], self.batch_size) if len(message) == 3 else None
                    if all(slot != held for held, _ in self.free):
                        self.free.append((slot, work))
        return self.free.popleft()


class _HandOff:
    """Tells the daemon a slot holds a finished batch: only its header crosses the ipc socket."""

    def __init__(self, sock: zmq.Socket, worker: int, config: WorkerConfig, stream_key: str, classes: int,
                 source: str) -> None:
        self.sock, self.worker, self.config, self.stream_key = sock, worker, config, stream_key
        self.classes, self.source = classes, source

    def __call__(self, slot: int, arrays: dict[str, np.ndarray], batch_no: int,
                 stages: Optional[dict[str, float]] = None) -> None:
        header = encode_batch(arrays, producer=self.config.producer_id,
                              seq=batch_no * self.config.workers + self.worker, worker=self.worker, stages=stages,
                              stream=self.stream_key, classes=self.classes, source=self.source)[0]
        self.sock.send_multipart([READY, slot_frame(slot), header])


def _load_pipeline(config: WorkerConfig) -> tuple[Any, SlotLayout]:
    """The pipeline, built in this process, and its slot layout, which must be the daemon's."""
    pipeline = load_pipeline(config.pipeline, dict(config.pipeline_args), dict(config.pipeline_standard))
    layout = SlotLayout(pipeline.batch_arrays(exact=config.exact), config.batch_size, config.slots)
    if layout.arrays != tuple(config.layout_arrays):
        raise RuntimeError(f"pipeline {config.pipeline} declares {layout.arrays} in this worker but "
                           f"{config.layout_arrays} in the daemon: it must not depend on the process it runs in")
    return pipeline, layout


def _add(stats: StageStats, worker: int, **values: float) -> None:
    for name, value in values.items():
        stats.add(worker, name, value)


def run_worker(worker: int, config: WorkerConfig, stats: StageStats, stop: Any, parent_pid: int,
               buffer: Any, routing_id: bytes, progress: WorkerProgress) -> None:
    """Process entry point. Returns when stopped; never raises on bad records or bad samples.

    ``buffer`` is this worker's shared memory (``batch_slots.allocate``); ``routing_id``
    names this process to the daemon, fresh for every (re)start; ``progress`` is where it says what it is doing
    (an error that ends it included), for the daemon to judge its death.
    """
    _die_with_parent()
    # The daemon owns shutdown: Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format)
    try:
        pipeline, layout = _load_pipeline(config)
        dataset = open_dataset(config.lmdb_path, config.remote)
        watch_storage(dataset, stats, worker)  # its waits on object storage: the status, stage times, metrics
    except Exception as exc:
        progress.failing(worker, f"{type(exc).__name__}: {exc}")
        raise
    progress.ready(worker)
    maker = BatchMaker(worker, config, pipeline, layout, buffer, dataset, stats, progress)
    # Named in every batch header, so a trainer sees producers whose shards overlap.
    stream_key = config.stream
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.endpoint)
    sock.send(HELLO)
    pool = _SlotPool(sock, config.slots, stop, parent_pid, config.batch_size)
    # The dataset's class count rides in every header too, so a trainer checks its model against it; and what the
    # dataset is ("webdataset s3://b/index.json"), which a plain-mode trainer has no hello to learn from.
    hand_off = _HandOff(sock, worker, config, stream_key, len(dataset.meta.classes),
                        source_label(source_kind(dataset), config.lmdb_path))
    batch_no = 0
    try:
        while not stop.is_set() and os.getppid() == parent_pid:
            t_wait = time.perf_counter()
            granted = pool.acquire()
            if granted is None:
                break
            slot, work = granted
            t_wait = time.perf_counter() - t_wait
            arrays = maker.views[slot]
            if maker.repeating:  # benchmark mode: re-send batches already made, as fast as the trainer takes them
                maker.repeat(slot, batch_no)
                hand_off(slot, arrays, batch_no)
                _add(stats, worker, send_s=t_wait, images=config.batch_size, batches=1)
                batch_no += 1
                continue
            fetched = stats.value(worker, "fetch_s")
            made = maker.make(slot, work, stop)
            if made is None:
                break
            t_read, t_transform, samples = made
            t_made = time.perf_counter()
            maker.keep(slot)
            stages = with_fetch(maker.stages(t_read, t_transform, t_wait), stats.value(worker, "fetch_s") - fetched)
            hand_off(slot, arrays, batch_no, stages)
            _add(stats, worker, read_s=stages["read"], decode_s=stages["decode"], augment_s=stages["augment"],
                 serialize_s=time.perf_counter() - t_made, send_s=t_wait, images=samples, batches=1)
            batch_no += 1
    finally:
        sock.close(linger=0)
        ctx.term()
        dataset.close()
