"""What a producer worker makes: records read and run through the pipeline, straight into a shared slot.

``BatchMaker`` fills one slot of the worker's shared buffer (``batch_slots``) with a batch: in exact mode the
records the daemon chose (a failed row keeps its index with ``mask`` False; rows past them are padding), otherwise
the next records of the worker's own deterministic stream (``sharding.worker_stream``). Each record's randomness is
a function of (seed, epoch, index) (``RecordRng``). A record that fails (a read error of any kind, a pipeline's
``SampleError``, a record that killed workers before) is skipped, counted and logged by key (``SkipLog``), never
fatal. The process around it, and its talk with the daemon, is worker.py.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from stoker.protocol.input_state import StreamKey

from stoker.producer.dataset.sources import RecordError, RecordSource, record_key
from stoker.producer.pipeline import SampleError
from stoker.producer.serve.batch_slots import SlotLayout, sample_rows
from stoker.producer.serve.block_layout import fetch_block_ahead
from stoker.producer.serve.sharding import EpochOrders, RecordRng, ShardLookahead, worker_stream
from stoker.producer.measure.stage_stats import StageStats
from stoker.producer.supervision.worker_progress import WorkerProgress

if TYPE_CHECKING:  # worker.py runs a BatchMaker
    from stoker.producer.serve.worker import WorkerConfig

log = logging.getLogger("stoker.producer.serve.worker")  # the worker's log: its skips are said as before

_LOG_EACH_SKIP = 10
_SKIP_SUMMARY_EVERY_S = 10.0


class SkipLog:
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


class BatchMaker:
    """Makes batches into this worker's slots: the records the daemon chose (exact mode) or the next ones of the
    worker's own stream of its shard. A record that fails is skipped, counted and logged, never fatal."""

    def __init__(self, worker: int, config: WorkerConfig, pipeline: Any, layout: SlotLayout, buffer: Any,
                 dataset: RecordSource, stats: StageStats, progress: WorkerProgress) -> None:
        self.worker, self.config, self.pipeline, self.dataset, self.stats = worker, config, pipeline, dataset, stats
        self.progress = progress  # the record being made, for the daemon to judge a death (producer/supervision/)
        self.views = layout.views(buffer)
        self.rows = [sample_rows(arrays) for arrays in self.views]
        self.rngs = RecordRng(config.seed)
        self.skips = SkipLog(worker)
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
        if following is not None:  # the shards of the next block, fetched ahead (block_layout.fetch_block_ahead)
            fetch_block_ahead(self.dataset, self.lookahead.key.block, following)
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
