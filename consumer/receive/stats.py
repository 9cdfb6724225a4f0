"""What a trainer's input counts, written by any number of receive threads: ``ReceiveStats``, the one writer of
the ``InputStats`` a facade's ``stats`` copies (``input_stats.py``: the counters as read).

Batches, bytes and samples per producer, rejected messages (logged rate-limited: the first
three one by one, then one line per 10 s with the count since the last line), connections
and failed handshakes, queue occupancy, and the producers' shards: each batch header names
the stream it belongs to (shard ``I/N`` of a dataset of ``count`` records with ``seed``), and
two producers whose streams overlap (shard counts that disagree, or the same shard with the
same seed) would serve records more than once per epoch; that is warned once per pair and
counted. No TensorFlow here: the framework-free ``BatchStream`` uses it too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

import numpy as np

from stoker.consumer.receive.coverage import Coverage
from stoker.consumer.receive.input_stats import InputStats
from stoker.consumer.receive.stream_index import StreamIndex
from stoker.protocol import ProtocolError
from stoker.protocol.peer_ids import place_of
from stoker.protocol.batch_spec import BatchMismatchError
from stoker.protocol.input_state import StreamKey

log = logging.getLogger("stoker.consumer")

_REJECT_LOG_EVERY_S = 10.0
MAX_MISMATCHED_PRODUCERS = 1024  # producer names tracked for ``misconfigured_producers`` (names are the sender's)
MAX_SOURCE_PRODUCERS = 4096  # producers whose source ``producer_sources`` keeps; past it the longest unchanged goes


def shard_conflict(a: str, a_stream: str, b: str, b_stream: str) -> Optional[str]:
    """Why producers ``a`` and ``b`` serving these streams would repeat records within an epoch, or None."""
    try:
        ka, kb = StreamKey.parse(a_stream), StreamKey.parse(b_stream)
    except ValueError:
        return None
    if ka.records != kb.records:
        return None  # different datasets: nothing to compare
    if ka.splits and kb.splits:
        return None  # one elastic pool: the trainers hand out splits, nothing overlaps
    if ka.splits or kb.splits:
        fixed, name = (kb, b) if ka.splits else (ka, a)
        return (f"producer {name} serves a fixed shard {fixed.index}/{fixed.count} of the same {ka.records}-record "
                f"dataset that an elastic pool (--shard auto) shares: records come more than once per epoch; start "
                "every producer of a pool with --shard auto")
    if ka.count != kb.count:
        why = f"their shard counts disagree ({ka.index}/{ka.count} vs {kb.index}/{kb.count})"
    elif ka.block != kb.block and ka.block and kb.block:
        why = f"they read the dataset in shards of {ka.block} and of {kb.block} records (two builds of it)"
    elif ka.block != kb.block:
        why = (f"one serves whole dataset shards of {ka.block or kb.block} records and the other every "
               f"{ka.count}-th record (a sharded dataset read with and without --shuffle-window 0)")
    elif ka.index == kb.index and ka.seed == kb.seed:
        why = f"both serve shard {ka.index}/{ka.count} with seed {ka.seed}"
    else:
        return None
    return (f"producers {a} (shard {ka.index}/{ka.count}, seed {ka.seed}) and {b} (shard {kb.index}/{kb.count}, "
            f"seed {kb.seed}) serve the same {ka.records}-record dataset and {why}: records come more than once per "
            "epoch; start N producers with --shard 0/N ... N-1/N (each a different shard, the same N)")


def _keep_latest(named: dict[str, str], key: str, value: str, bound: int) -> None:
    """Set ``named[key]`` last in order; past ``bound`` keys, drop the one set longest ago (a producer restarted
    comes back under a new id: an old one's entry would otherwise stay for the run)."""
    named.pop(key, None)
    if len(named) >= bound:
        del named[next(iter(named))]
    named[key] = value


class ReceiveStats:
    """Thread-safe counters behind ``InputStats``; see the module doc."""

    def __init__(self) -> None:
        self._stats = InputStats()
        self._lock = threading.Lock()
        self.rejected_since_batch = 0  # rejects since the last accepted batch, for the timeout's message
        self._last_reject_log = -_REJECT_LOG_EVERY_S
        self._unlogged_rejects = 0
        self._conflicting: set[frozenset[str]] = set()
        self._streams = StreamIndex()  # the producers a new stream may overlap, without comparing with every one
        self._endpoint_errors: dict[str, str] = {}  # endpoint -> why it is not connected (direct receive)
        # producer that never sent an acceptable batch -> (batches refused as BatchMismatchError, the latest why)
        self._mismatched: dict[str, tuple[int, str]] = {}
        self._coverage = Coverage()
        self._last_batch_at: dict[str, float] = {}  # producer -> when its last batch was accepted (monotonic)

    def snapshot(self) -> InputStats:
        with self._lock:
            s = self._stats
            return replace(s, per_producer=dict(s.per_producer), samples_per_producer=dict(s.samples_per_producer),
                           stage_seconds={p: dict(t) for p, t in s.stage_seconds.items()},
                           producer_streams=dict(s.producer_streams), producer_sources=dict(s.producer_sources),
                           coverage=self._coverage.snapshot(),
                           coverage_untracked_batches=self._coverage.untracked_batches)

    def accepted(self, batch: Any, arrays: Sequence[np.ndarray]) -> Optional[str]:
        """Count a batch the input took; returns a shard conflict it reveals for the first time, else None."""
        header = batch.header
        producer = header.producer
        # Real samples: an exact run's last batch is padded (mask); otherwise every row.
        samples = int(batch["mask"].sum()) if "mask" in batch.arrays else len(arrays[0]) if arrays else 0
        conflict = None
        with self._lock:
            stats = self._stats
            self.rejected_since_batch = 0
            self._mismatched.pop(producer, None)  # a producer that sent an acceptable batch is not misconfigured
            stats.batches += 1
            stats.bytes += sum(a.nbytes for a in arrays)
            stats.per_producer[producer] = stats.per_producer.get(producer, 0) + 1
            self._last_batch_at[producer] = time.monotonic()
            stats.samples_per_producer[producer] = stats.samples_per_producer.get(producer, 0) + samples
            if header.stages:
                stages = stats.stage_seconds.setdefault(producer, {})
                for name, seconds in header.stages.items():
                    stages[name] = stages.get(name, 0.0) + seconds
            if "index" in batch.arrays and "epoch" in batch.arrays:
                rows = batch["mask"].astype(bool) if "mask" in batch.arrays else slice(None)
                self._coverage.add(header.stream, np.asarray(batch["epoch"]), np.asarray(batch["index"]), rows)
            stats.dataset_classes = max(stats.dataset_classes, header.classes)
            if header.source and stats.producer_sources.get(producer) != header.source:
                _keep_latest(stats.producer_sources, producer, header.source, MAX_SOURCE_PRODUCERS)
            if header.stream and stats.producer_streams.get(producer) != header.stream:
                stats.producer_streams[producer] = header.stream
                self._streams.put(producer, header.stream)
                conflict = self._check_streams(producer, header.stream)
        if conflict:
            log.warning("%s", conflict)
        return conflict

    def _check_streams(self, producer: str, stream: str) -> Optional[str]:
        """Caller holds the lock. A producer restarted at the same place (``place_of``: a new instance id) is
        the same producer, not a second one serving its shard."""
        found = None
        for other in self._streams.candidates(producer):
            other_stream = self._stats.producer_streams[other]
            pair = frozenset((producer, other))
            if place_of(other) == place_of(producer) or pair in self._conflicting:
                continue
            why = shard_conflict(other, other_stream, producer, stream)
            if why:
                self._conflicting.add(pair)
                self._stats.shard_conflicts += 1
                self._stats.last_shard_conflict = found = why
        return found

    def rejected(self, exc: ProtocolError) -> None:
        with self._lock:
            if isinstance(exc, BatchMismatchError):
                self._stats.mismatched_batches += 1
                if exc.producer and exc.producer not in self._stats.per_producer and (
                        exc.producer in self._mismatched or len(self._mismatched) < MAX_MISMATCHED_PRODUCERS):
                    self._mismatched[exc.producer] = (self._mismatched.get(exc.producer, (0, ""))[0] + 1, str(exc))
            else:
                self._stats.protocol_errors += 1
            count = self._stats.protocol_errors + self._stats.mismatched_batches
            self._stats.last_error = str(exc)
            self.rejected_since_batch += 1
            self._unlogged_rejects += 1
            now = time.monotonic()
            # The first few one by one, then one line per interval: bad traffic must not flood the log.
            log_now = count <= 3 or now - self._last_reject_log >= _REJECT_LOG_EVERY_S
            if log_now:
                unlogged, self._last_reject_log, self._unlogged_rejects = self._unlogged_rejects, now, 0
        if log_now:
            log.warning("rejected message #%d (%d since the last warning): %s", count, unlogged, exc)

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._stats.last_error

    def _connected_now(self, endpoints: set[str]) -> tuple[list[str], list[str]]:
        """Set the connected endpoints (the caller holds the lock) and count each producer that joined (its
        connection came up) or left (it went down: stopped, killed, restarting, cut off; or its address left the
        pool). The one place that counts them, fed alike by a static address list and by discovery, in every mode
        and receiver, so ``producers_joined - producers_left`` is always the producers connected now."""
        s = self._stats
        before = set(s.connected_endpoints)
        joined, left = sorted(endpoints - before), sorted(before - endpoints)
        s.producers_joined += len(joined)
        s.producers_left += len(left)
        s.connected_endpoints, s.connected_producers = tuple(sorted(endpoints)), len(endpoints)
        return joined, left

    def _log_membership(self, joined: Sequence[str], left: Sequence[str]) -> None:
        """Say who joined and who left (outside the lock: logging may block)."""
        if not joined and not left:
            return
        s = self.snapshot()
        totals = f"{s.connected_producers} connected now; {s.producers_joined} joined, {s.producers_left} left so far"
        for endpoint in joined:
            log.info("producer at %s joined (%s)", endpoint, totals)
        for endpoint in left:
            log.info("producer at %s left: its connection ended (stopped, restarting or cut off) or its address "
                     "left the pool (%s)", endpoint, totals)

    def set_connections(self, connected: set[str], failures: int, reason: str, reconnects: int) -> None:
        """The whole picture from libzmq's socket monitors."""
        with self._lock:
            joined, left = self._connected_now(set(connected))
            self._stats.handshake_failures = failures
            self._stats.last_handshake_error = reason
            self._stats.reconnects = reconnects
        self._log_membership(joined, left)

    def connection_changed(self, endpoint: str, connected: bool, reason: str, handshake_failed: bool,
                           drops: int = 1) -> bool:
        """One endpoint's news from a direct receiver; True if it was connected before (a lost connection)."""
        with self._lock:
            if handshake_failed:
                self._stats.handshake_failures += 1
                self._stats.last_handshake_error = f"{endpoint}: {reason}"
            endpoints = set(self._stats.connected_endpoints)
            was = endpoint in endpoints
            if connected:
                endpoints.add(endpoint)
                self._endpoint_errors.pop(endpoint, None)
            else:
                if was:
                    self._stats.reconnects += max(1, drops)
                endpoints.discard(endpoint)
                self._endpoint_errors[endpoint] = reason
            came, went = self._connected_now(endpoints)
        self._log_membership(came, went)
        return was

    def pool_changed(self, joined: Sequence[str], left: Sequence[str], size: int) -> None:
        """The producer pool changed (discovery): its size now; producers whose address left are no longer
        connected (counted as left if they were). Addresses that joined count once their producer connects."""
        with self._lock:
            self._stats.pool_size = size
            _, went = self._connected_now(set(self._stats.connected_endpoints) - set(left))
            for endpoint in left:
                self._endpoint_errors.pop(endpoint, None)
        self._log_membership((), went)

    def last_batch_ages(self) -> dict[str, float]:
        """Per producer heard from, seconds since its last accepted batch."""
        now = time.monotonic()
        with self._lock:
            return {p: now - t for p, t in sorted(self._last_batch_at.items())}

    def misconfigured_producers(self, refused: int) -> dict[str, str]:
        """Before the input accepted any batch: the producers that sent at least ``refused`` batches that cannot
        match its spec and none that could, each with the latest reason; ``{}`` once a batch was accepted (from then
        on a mismatch is only counted: bad messages among good ones never fail the input)."""
        with self._lock:
            if self._stats.batches:
                return {}
            return {p: why for p, (count, why) in self._mismatched.items() if count >= refused}

    def batches_counted(self) -> int:
        """Batches accepted so far, without copying the stats (the sampler reads it 20 times a second)."""
        with self._lock:
            return self._stats.batches

    def pool_producers(self) -> int:
        """Producers in the pool now: its addresses, or the endpoints connected if more (a static list)."""
        with self._lock:
            return max(self._stats.pool_size, self._stats.connected_producers)

    def connected_count(self) -> int:
        """Producer endpoints connected now (``InputStats.connected_producers``) without copying the stats."""
        with self._lock:
            return self._stats.connected_producers

    def endpoint_errors(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._endpoint_errors.items())

    def set_control(self, sent: int, bytes_sent: int, received: int, bytes_received: int,
                    liveness_sent: int = 0, liveness_received: int = 0) -> None:
        """Exact mode's control messages so far (totals, from the receive thread); of their bytes, liveness's."""
        with self._lock:
            s = self._stats
            s.control_sent, s.control_bytes_sent, s.control_received, s.control_bytes_received = \
                sent, bytes_sent, received, bytes_received
            s.liveness_bytes_sent, s.liveness_bytes_received = liveness_sent, liveness_received

    def set_pool_work(self, reserved: int, backed_up: int, wasted: int, stuck: int, stall_warnings: int) -> None:
        """Exact mode's liveness counters so far (totals, from the receive thread)."""
        with self._lock:
            s = self._stats
            s.splits_reserved, s.splits_backed_up, s.wasted_records, s.producers_stuck, s.stall_warnings = \
                reserved, backed_up, wasted, stuck, stall_warnings

    def add_occupancy(self, fraction: float) -> None:
        with self._lock:
            self._stats.occupancy_sum += fraction
            self._stats.occupancy_samples += 1
