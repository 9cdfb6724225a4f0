"""What a trainer's input counted, as its users and watchers read it: ``InputStats`` and what is read from it.

``InputStats`` is the consistent copy ``inp.stats`` returns (``ReceiveStats``, ``stats.py``, is its one writer,
from the receive threads); ``producer_tallies`` and ``silent_producers`` read a run's producers from snapshots
(``stoker train``'s summary); ``WatchedInput`` is an input as its watchers (the Keras callback, the Prometheus
collector, the timeline) see it. No TensorFlow here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from stoker.consumer.sizing.pool_sizing import PoolSizing


@dataclass
class InputStats:
    """Counters of one input (ZMQInput or BatchStream). ``stats`` returns a consistent copy."""

    batches: int = 0
    bytes: int = 0
    protocol_errors: int = 0
    mismatched_batches: int = 0
    reconnects: int = 0
    connected_producers: int = 0
    connected_endpoints: tuple[str, ...] = ()
    handshake_failures: int = 0
    last_handshake_error: str = ""
    last_error: str = ""
    per_producer: dict[str, int] = field(default_factory=dict)
    samples_per_producer: dict[str, int] = field(default_factory=dict)
    #: producer -> stage (read, decode, augment, send: waiting to hand off) -> seconds its workers spent on what we received
    stage_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    occupancy_sum: float = 0.0
    occupancy_samples: int = 0
    #: producer -> the stream it serves (``I/N:records:seed``), from its batch headers
    producer_streams: dict[str, str] = field(default_factory=dict)
    #: producer -> the dataset it serves, ``"<kind> <location>"`` (``"webdataset s3://b/laion/index.json"``), the
    #: latest its batch headers named (producers of an older release name none); at most ``MAX_SOURCE_PRODUCERS``
    producer_sources: dict[str, str] = field(default_factory=dict)
    #: the most classes any producer's dataset names in its batch headers (0: none said); ``stoker train`` checks
    #: its model's class count against it
    dataset_classes: int = 0
    #: pairs of producers whose shards overlap (each pair counted once), and what the latest said
    shard_conflicts: int = 0
    last_shard_conflict: str = ""
    #: exact mode's control plane (docs/protocol.md): hellos, credits and consumed-record reports this
    #: trainer sent, status messages it received; messages and bytes (0 in plain mode)
    control_sent: int = 0
    control_bytes_sent: int = 0
    control_received: int = 0
    control_bytes_received: int = 0
    #: of those bytes, liveness: heartbeats sent (a credit message with no credit and no records), statuses received
    liveness_bytes_sent: int = 0
    liveness_bytes_received: int = 0
    #: the producer pool (``consumer/transport/discovery.py``): its addresses now; producers that joined (a connection
    #: came up, those at the start included) and left (a connection ended, or its address left the pool) since the
    #: start, counted alike for a static address list and for discovery: joined - left = connected now
    pool_size: int = 0
    producers_joined: int = 0
    producers_left: int = 0
    #: an elastic pool's liveness (``split_scheduler``): splits handed out again because their producer was stuck,
    #: backup splits given to idle producers for a straggler's, rows dropped because their record had arrived
    #: from another producer first (the work those copies cost), and times a producer was taken for stuck
    splits_reserved: int = 0
    splits_backed_up: int = 0
    wasted_records: int = 0
    producers_stuck: int = 0
    #: fixed-shard exact mode: warnings that a producer holding this trainer's records sends nothing
    stall_warnings: int = 0
    #: (shard, epoch) -> (distinct records the input received, records in that shard), from the batches'
    #: ``index``/``epoch`` rows and the stream their headers name (``consumer/receive/coverage.py``): shard ``"I/N"`` where
    #: each producer counts its own shard's epochs, ``"all"`` for the whole dataset (an elastic pool, shard 0/1);
    #: the last ``COVERAGE_EPOCHS`` epochs of each shard. Received, not trained on: queued batches count too.
    coverage: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    #: batches of shards past ``Coverage``'s bounds (too many shards), not in ``coverage``
    coverage_untracked_batches: int = 0
    #: how many producers this input needs and why (``consumer/sizing``), as of the snapshot
    sizing: Optional[PoolSizing] = None
    #: the producer the input started on its host (``local_producer=``, ``stoker train --local-producer``) exited
    #: unasked (0 or 1: it is not restarted; the remote producers go on), logged with its log's tail
    local_producer_deaths: int = 0

    @property
    def mean_queue_occupancy(self) -> float:
        """Time-sampled mean fraction of queue capacity in use (near 0: input-bound)."""
        return self.occupancy_sum / self.occupancy_samples if self.occupancy_samples else 0.0


@dataclass(frozen=True)
class ProducerTally:
    """What one producer delivered: batches and images over the whole run, images/s over a timed window."""

    producer: str
    batches: int
    images: int
    images_per_s: float

    def line(self) -> str:
        return f"{self.producer}: {self.batches:,} batches, {self.images:,} images, {self.images_per_s:.0f} images/s"


def producer_tallies(end: InputStats, start: InputStats, seconds: float) -> list[ProducerTally]:
    """One tally per producer that sent a batch, by id: batches and images counted up to ``end``; images/s =
    images received between the ``start`` and ``end`` snapshots / ``seconds`` (0 if ``seconds`` is not > 0)."""
    return [ProducerTally(p, n, end.samples_per_producer.get(p, 0),
                          (end.samples_per_producer.get(p, 0) - start.samples_per_producer.get(p, 0)) / seconds
                          if seconds > 0 else 0.0)
            for p, n in sorted(end.per_producer.items())]


def silent_producers(stats: InputStats) -> int:
    """A lower bound on the producers connected now that sent no batch yet: connected endpoints beyond the
    producers heard from. They are counted, not named: a producer's id comes with its first batch."""
    return max(0, stats.connected_producers - len(stats.per_producer))


class WatchedInput(Protocol):
    """An input as its watchers see it (the Keras callback, the Prometheus collector, the timeline): a facade's
    counters and occupancy, nothing of its framework. ``ZMQInput`` and ``BatchStream`` both fit."""

    batch_size: int

    @property
    def stats(self) -> InputStats: ...

    def queue_occupancy(self) -> float: ...

    def raise_if_failed(self) -> None: ...

