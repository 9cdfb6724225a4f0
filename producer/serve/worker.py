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
from stoker.producer.dataset.format import LmdbDataset, RecordError, record_key
from stoker.producer.serve.logs import configure_logging
from stoker.producer.pipeline import SampleError, load_pipeline
from stoker.producer.serve.sharding import RecordRng, ShardSpec, worker_stream
from stoker.producer.measure.stage_stats import StageStats

log = logging.getLogger("stoker.producer.serve.worker")

_LOG_EACH_SKIP = 10
_SKIP_SUMMARY_EVERY_S = 10.0


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs; plain data so it crosses ``spawn`` safely."""

    lmdb_path: str
    endpoint: str
    producer_id: str
    shard: ShardSpec
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


def run_worker(worker: int, config: WorkerConfig, stats: StageStats, stop: Any, parent_pid: int,
               buffer: Any, routing_id: bytes) -> None:
    """Process entry point. Returns when stopped; never raises on bad records or bad samples.

    ``buffer`` is this worker's shared memory (``batch_slots.allocate``); ``routing_id``
    names this process to the daemon, fresh for every (re)start.
    """
    _die_with_parent()
    # The daemon owns shutdown: Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(config.log_level, config.log_format)
    pipeline = load_pipeline(config.pipeline, dict(config.pipeline_args), dict(config.pipeline_standard))
    layout = SlotLayout(pipeline.batch_arrays(exact=config.exact), config.batch_size, config.slots)
    if layout.arrays != tuple(config.layout_arrays):
        raise RuntimeError(f"pipeline {config.pipeline} declares {layout.arrays} in this worker but "
                           f"{config.layout_arrays} in the daemon: it must not depend on the process it runs in")
    dataset = LmdbDataset(config.lmdb_path)
    records = config.shard.records(len(dataset))
    # Named in every batch header, so a trainer sees producers whose shards overlap.
    stream_key = str(StreamKey(config.shard.index, config.shard.count, len(dataset), config.seed))
    stream = worker_stream(records, config.seed, worker, config.workers, shuffle=True)
    batch_size = config.batch_size
    views = layout.views(buffer)
    rows = [sample_rows(arrays) for arrays in views]
    rngs = RecordRng(config.seed)
    skips = _SkipLog(worker)
    stage_times = pipeline.stage_times
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.endpoint)
    sock.send(HELLO)
    pool = _SlotPool(sock, config.slots, stop, parent_pid, batch_size)

    def hand_off(slot: int, arrays: dict[str, np.ndarray], batch_no: int,
                 stages: Optional[dict[str, float]] = None) -> None:
        """Tell the daemon ``slot`` holds a finished batch: only its header crosses the ipc socket."""
        header = encode_batch(arrays, producer=config.producer_id, seq=batch_no * config.workers + worker,
                              worker=worker, stages=stages, stream=stream_key)[0]
        sock.send_multipart([READY, slot_frame(slot), header])

    batch_no = 0
    made: list[dict[str, np.ndarray]] = []
    try:
        while not stop.is_set() and os.getppid() == parent_pid:
            t_wait = time.perf_counter()
            granted = pool.acquire()
            if granted is None:
                break
            slot, work = granted
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
            indices, epochs = arrays["index"], arrays["epoch"]
            t_read = t_transform = 0.0
            if work is not None:  # exact mode: the daemon chose the records; failed rows are masked out
                t_read, t_transform, samples = _make_chosen(work, dataset, pipeline, rngs, rows[slot], arrays, skips)
                stats.add(worker, "skipped", len(work) - samples)
                filled = batch_size
            else:
                filled, samples = 0, batch_size
            while filled < batch_size and not stop.is_set():
                epoch, index = next(stream)
                t0 = time.perf_counter()
                try:
                    record = dataset.read(index)
                    t1 = time.perf_counter()
                    pipeline.write(record, rngs.for_record(epoch, index), rows[slot][filled])
                    t2 = time.perf_counter()
                except (RecordError, SampleError) as exc:
                    stats.add(worker, "skipped", 1)
                    skips.skip(index, str(exc))
                    continue
                t_read, t_transform = t_read + t1 - t0, t_transform + t2 - t1
                indices[filled], epochs[filled] = index, epoch
                filled += 1
            if filled < batch_size:
                break
            t4 = time.perf_counter()
            if len(made) < config.repeat_batches:
                made.append({name: array.copy() for name, array in arrays.items()})
            # A user pipeline's own decode timing is clamped: a header the trainer would refuse loses the batch.
            t_decode = stage_times().get("decode", 0.0) if stage_times is not None else 0.0
            t_decode = min(max(t_decode, 0.0), t_transform) if math.isfinite(t_decode) else 0.0
            t_augment = max(0.0, t_transform - t_decode)
            hand_off(slot, arrays, batch_no,
                     {"read": t_read, "decode": t_decode, "augment": t_augment, "send": t_wait})
            for name, value in (
                ("read_s", t_read), ("decode_s", t_decode), ("augment_s", t_augment),
                ("serialize_s", time.perf_counter() - t4), ("send_s", t_wait), ("images", samples), ("batches", 1),
            ):
                stats.add(worker, name, value)
            batch_no += 1
    finally:
        sock.close(linger=0)
        ctx.term()
        dataset.close()


def _make_chosen(work: list[tuple[int, int]], dataset: LmdbDataset, pipeline: Any, rngs: RecordRng,
                 rows: list[dict[str, np.ndarray]], arrays: dict[str, np.ndarray], skips: _SkipLog) -> tuple[float, float, int]:
    """Make the batch the daemon chose (exact mode): ``(read seconds, transform seconds, samples made)``.

    A row that fails keeps its record index with ``mask`` False (the daemon counts it as skipped);
    rows past the chosen records are padding: zeroed, index and epoch -1, ``mask`` False.
    """
    t_read = t_transform = 0.0
    mask, indices, epochs = arrays["mask"], arrays["index"], arrays["epoch"]
    made = 0
    for row, (epoch, index) in enumerate(work):
        indices[row], epochs[row] = index, epoch
        t0 = time.perf_counter()
        try:
            record = dataset.read(index)
            t1 = time.perf_counter()
            pipeline.write(record, rngs.for_record(epoch, index), rows[row])
            t2 = time.perf_counter()
        except (RecordError, SampleError) as exc:
            skips.skip(index, str(exc))
            mask[row] = False
            continue
        t_read, t_transform = t_read + t1 - t0, t_transform + t2 - t1
        mask[row] = True
        made += 1
    for row in range(len(work), len(mask)):
        for name, array in arrays.items():
            array[row] = 0
        indices[row], epochs[row], mask[row] = -1, -1, False
    return t_read, t_transform, made
