"""Prometheus metrics of a trainer's input (any facade: ZMQInput, BatchStream, TorchInput), computed at scrape time
from its stats (``InputBase.serve_metrics``). Imports no framework."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stoker.consumer.sizing import DESIRED_PRODUCERS_METRIC, PRODUCERS_NEEDED_METRIC

if TYPE_CHECKING:
    from stoker.consumer.receive.input_stats import WatchedInput
    from stoker.consumer.sizing.pool_sizing import PoolSizing


class InputCollector(Collector):
    """Batches and bytes received (per producer), rejected messages, occupancy, connected producers."""

    def __init__(self, inp: "WatchedInput") -> None:
        self.inp = inp

    def collect(self) -> Iterator:
        s = self.inp.stats
        per = CounterMetricFamily("stoker_trainer_batches_received", "Batches received", labels=["producer"])
        for producer, n in sorted(s.per_producer.items()):
            per.add_metric([producer], n)
        yield per
        sources = GaugeMetricFamily("stoker_trainer_producer_source_info", "The dataset each producer serves, "
                                    "'<kind> <location>' as its latest batch named it; always 1",
                                    labels=["producer", "source"])
        for producer, source in sorted(s.producer_sources.items()):
            sources.add_metric([producer, source], 1)
        yield sources
        yield CounterMetricFamily("stoker_trainer_images_received", "Images received",
                                  value=s.batches * self.inp.batch_size)
        yield CounterMetricFamily("stoker_trainer_bytes_received", "Array bytes received", value=s.bytes)
        yield CounterMetricFamily("stoker_trainer_protocol_errors", "Malformed messages rejected",
                                  value=s.protocol_errors)
        yield CounterMetricFamily("stoker_trainer_mismatched_batches", "Batches of the wrong shape rejected",
                                  value=s.mismatched_batches)
        yield CounterMetricFamily("stoker_trainer_shard_conflicts", "Pairs of producers whose shards overlap",
                                  value=s.shard_conflicts)
        yield CounterMetricFamily("stoker_trainer_handshake_failures",
                                  "Connection handshakes that failed (CurveZMQ keys missing, wrong or not authorised)",
                                  value=s.handshake_failures)
        yield CounterMetricFamily("stoker_trainer_reconnects", "Endpoints re-connected after protocol errors",
                                  value=s.reconnects)
        try:
            occupancy = self.inp.queue_occupancy()
        except Exception:  # closed
            occupancy = 0.0
        yield GaugeMetricFamily("stoker_trainer_queue_occupancy", "FIFOQueue fill fraction now (near 0: input-bound)",
                                value=occupancy)
        yield GaugeMetricFamily("stoker_trainer_mean_queue_occupancy", "Time-sampled mean FIFOQueue fill fraction",
                                value=s.mean_queue_occupancy)
        yield GaugeMetricFamily("stoker_trainer_connected_producers", "Producer endpoints connected now",
                                value=s.connected_producers)
        yield GaugeMetricFamily("stoker_trainer_pool_producers", "Producers the addresses resolve to now",
                                value=s.pool_size)
        yield CounterMetricFamily("stoker_trainer_producers_joined", "Producers whose connection came up since the "
                                  "start (those at the start included; joined - left = connected now)",
                                  value=s.producers_joined)
        yield CounterMetricFamily("stoker_trainer_producers_left", "Producers whose connection ended (stopped, "
                                  "restarting, cut off) or whose address left the pool since the start",
                                  value=s.producers_left)
        yield CounterMetricFamily("stoker_trainer_splits_reserved",
                                  "Elastic pool: splits handed out again because their producer was stuck",
                                  value=s.splits_reserved)
        yield CounterMetricFamily("stoker_trainer_splits_backed_up",
                                  "Elastic pool: splits also handed to an idle producer because their holder straggled",
                                  value=s.splits_backed_up)
        yield CounterMetricFamily("stoker_trainer_wasted_records",
                                  "Exact mode: records dropped because another producer's copy arrived first",
                                  value=s.wasted_records)
        yield CounterMetricFamily("stoker_trainer_producers_stuck",
                                  "Elastic pool: times a producer holding work was taken for stuck (its work re-served)",
                                  value=s.producers_stuck)
        yield CounterMetricFamily("stoker_trainer_stall_warnings",
                                  "Fixed shards: warnings that a producer holding this trainer's records sends nothing",
                                  value=s.stall_warnings)
        coverage = GaugeMetricFamily("stoker_trainer_epoch_coverage",
                                     "Distinct records the input received (queued batches too) / records in the "
                                     "shard, per shard and epoch of each shard's last few; shard I/N where each "
                                     "producer counts its own shard's epochs; all: the whole dataset (a pool, 0/1)",
                                     labels=["shard", "epoch"])
        for (shard, epoch), (seen, records) in s.coverage.items():
            coverage.add_metric([shard, str(epoch)], seen / records if records else 0.0)
        yield coverage
        yield CounterMetricFamily("stoker_trainer_local_producer_deaths", "Times the producer this trainer started "
                                  "on its own host (--local-producer) died unasked; it is not restarted",
                                  value=s.local_producer_deaths)
        sizing = getattr(self.inp, "sizing", None)
        if sizing is not None:
            yield from sizing_metrics(sizing)


def sizing_metrics(sizing: "PoolSizing") -> Iterator:
    """The pool-size estimate and its formula's inputs (``consumer/sizing``); a value not known yet is left out, so
    a sum over a job's trainers counts only those that know."""
    d, s = sizing.demand, sizing.supply
    known = [
        (PRODUCERS_NEEDED_METRIC, "Producers this trainer's demand needs, headroom included, fractional: sum over a "
         "job's trainers, then round up once", sizing.producers_needed),
        (DESIRED_PRODUCERS_METRIC, "This trainer's own answer, rounded, with hysteresis (a one-trainer job)",
         sizing.desired_producers),
        ("stoker_trainer_demand_images_per_s", "Images/s the step would take if it never waited for input",
         d.images_per_s if d else None),
        ("stoker_trainer_consumed_images_per_s", "Images/s the step took (the last window)",
         d.consumed_images_per_s if d else None),
        ("stoker_trainer_input_wait_fraction", "Share of the last window the trainer waited for input",
         d.wait_fraction if d else None),
        ("stoker_trainer_producer_capacity_images_per_s", "Mean images/s one producer makes when its workers do not "
         "wait to hand off (from the batches' stage times)", s.per_producer_images_per_s if s else None),
        ("stoker_trainer_local_producer_capacity_images_per_s", "Images/s the producers on this trainer's host "
         "make (--local-producer): producers_needed counts the remote producers for what they leave",
         s.local_images_per_s if s else None),
        ("stoker_trainer_sizing_headroom", "Supply kept above demand in producers_needed", sizing.headroom),
    ]
    for name, help_text, value in known:
        if value is not None:
            yield GaugeMetricFamily(name, help_text, value=float(value))
