"""Prometheus metrics of a producer daemon, read from the workers' shared counters at scrape time.

Served by ``stoker.protocol.metrics_server.MetricsServer`` (own registry, no global state).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stoker.producer.measure.stage_stats import STAGE_NAMES, StageStats


class ProducerCollector(Collector):
    """Batches, images, bytes sent, records skipped, failed handshakes, per-stage seconds, live workers."""

    def __init__(self, stats: StageStats, batch_bytes: int, producer_id: str, workers_alive: Callable[[], int],
                 handshake_failures: Callable[[], int] = lambda: 0, source: tuple[str, str] = ("", "")) -> None:
        self.stats, self.batch_bytes, self.labels = stats, batch_bytes, {"producer": producer_id}
        self.workers_alive = workers_alive
        self.handshake_failures = handshake_failures
        self.source = source  # (kind, location): what the producer reads (``record_source.source_kind``)

    def collect(self) -> Iterator:
        t = self.stats.totals()
        names = ["producer"]
        for name, doc, value in (
            ("stoker_producer_batches_sent", "Batches handed to the send socket", t["batches"]),
            ("stoker_producer_images_sent", "Images in batches sent", t["images"]),
            ("stoker_producer_bytes_sent", "Array bytes in batches sent", t["batches"] * self.batch_bytes),
            ("stoker_producer_records_skipped", "Corrupt or undecodable records skipped", t["skipped"]),
            ("stoker_producer_handshake_failures", "Trainer connections refused at the handshake (CurveZMQ)",
             self.handshake_failures()),
            ("stoker_producer_fetch_errors", "Object storage calls that failed and were tried again", t["fetch_errors"]),
        ):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric([self.labels["producer"]], value)
            yield c
        stage = CounterMetricFamily("stoker_producer_stage_seconds", "Seconds spent per stage, summed over workers",
                                    labels=["producer", "stage"])
        for s in STAGE_NAMES:  # fetch: what reads waited for object storage
            stage.add_metric([self.labels["producer"], s], t[f"{s}_s"])
        yield stage
        waiting = GaugeMetricFamily("stoker_producer_storage_waiting",
                                    "Workers waiting on object storage now (a failing call tried again)", labels=names)
        waiting.add_metric([self.labels["producer"]], len(self.stats.storage_waits()))
        yield waiting
        source = GaugeMetricFamily("stoker_producer_source_info", "What this producer reads: the source's kind "
                                   "(lmdb, lmdb-shards, webdataset, parquet) and location; always 1",
                                   labels=["producer", "kind", "location"])
        source.add_metric([self.labels["producer"], *self.source], 1)
        yield source
        g = GaugeMetricFamily("stoker_producer_workers_alive", "Worker processes running", labels=names)
        g.add_metric([self.labels["producer"]], self.workers_alive())
        yield g
