"""One producer worker process: read records, run the pipeline into shared memory, hand off.

Runs in a child process started with the ``spawn`` method (no fork surprises:
LMDB and ZMQ handles are opened here, fresh; the pipeline is built here from its
reference, so user code is imported in the worker). Each sample is written
straight into a free slot of the worker's shared buffer (``batch_slots``); the
worker then tells the daemon "slot S is ready" with the batch header, and the
daemon sends the slot's memory to the trainer. With no free slot the worker
waits: that is the backpressure, and it bounds memory.

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
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import zmq

from stoker.protocol import encode_batch
from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.batch_slots import GRANT, HELLO, READY, SlotLayout, decode_work, parse_slot, sample_rows, slot_frame
from stoker.producer.dataset.sources import (LmdbDataset, RecordError, RemoteOptions, ShardedDataset, open_dataset,
                                             record_key)
from stoker.producer.serve.logs import configure_logging
from stoker.producer.pipeline import SampleError, load_pipeline
from stoker.producer.serve.sharding import EpochOrders, RecordRng, ShardLookahead, worker_stream
from stoker.producer.measure.stage_stats import StageStats, watch_storage, with_fetch
from stoker.producer.supervision.worker_progress import WorkerProgress

log = logging.getLogger("stoker.producer.serve.worker")

_LOG_EACH_SKIP = 10
_SKIP_SUMMARY_EVERY_S = 10.0


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


class _SkipLog:
    """Logs skipped records by key: the first few one by one, then a summary every interval."""

    def __init__(self, worker: int) -> None:
        self.worker, self.count, self.unlogged, self.last = worker, 0, 0, 0.0
        self.last_reason = ""

    def skip(self, index: int, reason: str) -> None:
        self.count += 1
        self.unlogged += 1
        self.last_reason = f"record {record_key(index).decode()}: {reason}"
        now = time.monotonic()
        if self.count <= _LOG_EACH_SKIP:
            log.warning("skipping record %s: %s", record_key(index).decode(), reason)
            self.unlogged, self.last = 0, now
        elif now - self.last >= _SKIP_SUMMARY_EVERY_S:
            log.warning("worker %d skipped %d more records in the last %.0f s (%d in all); the last: skipping %s",
                        self.worker, self.unlogged, now - self.last, self.count, self.last_reason)
            self.unlogged, self.last = 0, now


class _BatchMaker:
    """Makes batches into this worker's slots: the records the daemon chose (exact mode) or the next ones of the
    worker's own stream of its shard. A record that fails is skipped, counted and logged, never fatal."""

    def __init__(self, worker: int, config: WorkerConfig, pipeline: Any, layout: SlotLayout, buffer: Any,
                 dataset: LmdbDataset | ShardedDataset, stats: StageStats, progress: WorkerProgress) -> None:
        self.worker, self.config, self.pipeline, self.dataset, self.stats = worker, config, pipeline, dataset, stats
        self.progress = progress  # the record being made, for the daemon to judge a death (producer/supervision/)
        self.views = layout.views(buffer)
        self.rows = [sample_rows(arrays) for arrays in self.views]
        self.rngs = RecordRng(config.seed)
        self.skips = _SkipLog(worker)
        orders = EpochOrders(StreamKey.parse(config.stream))
        self.stream = worker_stream(orders, worker, config.workers)
        self.lookahead = ShardLookahead(orders)  # shard by shard: the next shard is fetched while this one is read
        self.kept: list[dict[str, np.ndarray]] = []  # --repeat-batches: the batches sent again and again

    def make(self, slot: int, work: Optional[list[tuple[int, int]]], stop: Any) -> Optional[tuple[float, float, int]]:
        """Fill ``slot``: ``(read seconds, transform seconds, samples made)``; None if stopped before it was full."""
        if work is not None:  # exact mode: the daemon chose the records; failed rows are masked out
            made = self._make_chosen(slot, work)
            self.stats.add(self.worker, "skipped", len(work) - made[2])
            return made
        return self._make_from_stream(slot, stop)

    def _make_row(self, rows: dict[str, np.ndarray], epoch: int, index: int) -> Optional[tuple[float, float]]:
        """Record ``index`` made into ``rows``: ``(read seconds, transform seconds)``, or None if it failed."""
        if self.progress.skips(index):
            self.skips.skip(index, "it killed worker processes (see the error above): skipped without reading")
            return None
        self.progress.making(self.worker, epoch, index)
        try:
            return self._make_read_row(rows, epoch, index)
        finally:
            self.progress.made(self.worker)

    def _make_read_row(self, rows: dict[str, np.ndarray], epoch: int, index: int) -> Optional[tuple[float, float]]:
        t0 = time.perf_counter()
        following = self.lookahead.after(epoch, index)
        if following is not None and isinstance(self.dataset, ShardedDataset):
            self.dataset.prefetch(following)
        try:
            record = self.dataset.read(index)
        except Exception as exc:  # RecordError, or whatever else a damaged file raises: never fatal (format.md)
            self.skips.skip(index, str(exc) if isinstance(exc, RecordError) else f"{type(exc).__name__}: {exc}")
            return None
        t1 = time.perf_counter()
        try:
            self.pipeline.write(record, self.rngs.for_record(epoch, index), rows)
        except SampleError as exc:
            self.skips.skip(index, str(exc))
            return None
        return t1 - t0, time.perf_counter() - t1

    def _make_from_stream(self, slot: int, stop: Any) -> Optional[tuple[float, float, int]]:
        arrays, rows, batch_size = self.views[slot], self.rows[slot], self.config.batch_size
        indices, epochs = arrays["index"], arrays["epoch"]
        t_read = t_transform = 0.0
        filled = 0
        while filled < batch_size and not stop.is_set():
            epoch, index = next(self.stream)
            times = self._make_row(rows[filled], epoch, index)
            if times is None:
                self.stats.add(self.worker, "skipped", 1)
                continue
            t_read, t_transform = t_read + times[0], t_transform + times[1]
            indices[filled], epochs[filled] = index, epoch
            filled += 1
        return (t_read, t_transform, filled) if filled == batch_size else None

    def _make_chosen(self, slot: int, work: list[tuple[int, int]]) -> tuple[float, float, int]:
        """Make the batch the daemon chose (exact mode): ``(read seconds, transform seconds, samples made)``.

        A row that fails keeps its record index with ``mask`` False (the daemon counts it as skipped);
        rows past the chosen records are padding: zeroed, index and epoch -1, ``mask`` False.
        """
        arrays, rows = self.views[slot], self.rows[slot]
        mask, indices, epochs = arrays["mask"], arrays["index"], arrays["epoch"]
        t_read = t_transform = 0.0
        made = 0
        for row, (epoch, index) in enumerate(work):
            indices[row], epochs[row] = index, epoch
            times = self._make_row(rows[row], epoch, index)
            mask[row] = times is not None
            if times is not None:
                t_read, t_transform = t_read + times[0], t_transform + times[1]
                made += 1
        for row in range(len(work), len(mask)):
            for array in arrays.values():
                array[row] = 0
            indices[row], epochs[row], mask[row] = -1, -1, False
        return t_read, t_transform, made

    def stages(self, t_read: float, t_transform: float, t_wait: float) -> dict[str, float]:
        """The header's stage times. A user pipeline's own decode timing is clamped: a header the trainer would
        refuse loses the batch."""
        stage_times = self.pipeline.stage_times
        t_decode = stage_times().get("decode", 0.0) if stage_times is not None else 0.0
        t_decode = min(max(t_decode, 0.0), t_transform) if math.isfinite(t_decode) else 0.0
        return {"read": t_read, "decode": t_decode, "augment": max(0.0, t_transform - t_decode), "send": t_wait}

    # ---- --repeat-batches (a benchmark of the transport) -----------------------------------------

    @property
    def repeating(self) -> bool:
        """Whether every batch it was to keep is kept: from now on they are sent again, not made."""
        return bool(self.config.repeat_batches) and len(self.kept) == self.config.repeat_batches

    def keep(self, slot: int) -> None:
        if len(self.kept) < self.config.repeat_batches:
            self.kept.append({name: array.copy() for name, array in self.views[slot].items()})

    def repeat(self, slot: int, batch_no: int) -> None:
        for name, array in self.kept[batch_no % len(self.kept)].items():
            np.copyto(self.views[slot][name], array)


class _HandOff:
    """Tells the daemon a slot holds a finished batch: only its header crosses the ipc socket."""

    def __init__(self, sock: zmq.Socket, worker: int, config: WorkerConfig, stream_key: str, classes: int) -> None:
        self.sock, self.worker, self.config, self.stream_key = sock, worker, config, stream_key
        self.classes = classes

    def __call__(self, slot: int, arrays: dict[str, np.ndarray], batch_no: int,
                 stages: Optional[dict[str, float]] = None) -> None:
        header = encode_batch(arrays, producer=self.config.producer_id,
                              seq=batch_no * self.config.workers + self.worker, worker=self.worker, stages=stages,
                              stream=self.stream_key, classes=self.classes)[0]
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
    maker = _BatchMaker(worker, config, pipeline, layout, buffer, dataset, stats, progress)
    # Named in every batch header, so a trainer sees producers whose shards overlap.
    stream_key = config.stream
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.endpoint)
    sock.send(HELLO)
    pool = _SlotPool(sock, config.slots, stop, parent_pid, config.batch_size)
    # The dataset's class count rides in every header too, so a trainer checks its model against it.
    hand_off = _HandOff(sock, worker, config, stream_key, len(dataset.meta.classes))
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
