"""What a training run measured (``TrainReport``) and how it is told: the summary ``stoker train`` prints, the
facts of its HTML report, and which producers sent what.

The figures exclude the warm-up steps (tracing, pre-fill) unless the run never got past them; coverage is what
the input received, not only what the steps trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from stoker.consumer.receive.coverage import WHOLE_DATASET, coverage_lines, coverage_text
from stoker.consumer.receive.input_stats import InputStats, ProducerTally, producer_tallies, silent_producers
from stoker.consumer.train.timeline import Timeline
from stoker.consumer.train.verdict import bottleneck_verdict


def has_liveness_events(s: InputStats) -> bool:
    return bool(s.producers_stuck or s.splits_backed_up or s.wasted_records or s.stall_warnings)


def liveness_text(s: InputStats) -> str:
    """What stuck and slow producers cost: work re-served or backed up, records made twice, warnings."""
    return (f"{s.producers_stuck} taken for stuck ({s.splits_reserved} split(s) re-served), {s.splits_backed_up} "
            f"backup split(s) for stragglers, {s.wasted_records:,} record(s) made twice and dropped (wasted work, "
            f"never a duplicate), {s.stall_warnings} warning(s) of a fixed-shard producer sending nothing")


#: what the coverage figures count: what arrived, not what the steps took
RECEIVED_NOT_TRAINED = "by the input: batches still queued or pre-filled count too, not only those trained on"


def per_shard(s: InputStats) -> bool:
    """Whether coverage is per shard: producers on fixed shards, each counting its own shard's epochs."""
    return any(label != WHOLE_DATASET for label, _ in s.coverage)


def untracked_text(s: InputStats) -> str:
    return (f"; {s.coverage_untracked_batches:,} batch(es) of shards past the number tracked not counted"
            if s.coverage_untracked_batches else "")


def coverage_summary(s: InputStats) -> list[str]:
    """The summary's lines on coverage (none if unknown): per shard where epochs are per shard, and saying what
    was counted: ``records received per epoch (...): epoch 3: 1,200/1,200 (100%), ...``."""
    lines = coverage_lines(s.coverage)
    if not lines:
        return []
    if not per_shard(s):
        return [f"records received per epoch ({RECEIVED_NOT_TRAINED}; the latest may be in progress"
                f"{untracked_text(s)}): {lines[0]}"]
    return [f"records received per shard and epoch (each producer counts its own shard's epochs; "
            f"{RECEIVED_NOT_TRAINED}; each shard's latest epoch may be in progress{untracked_text(s)}):",
            *(f"  {line}" for line in lines)]


#: producers named per dataset where producers serve different ones; the rest are counted
NAMED_PER_SOURCE = 8


def _named(producers: list[str]) -> str:
    more = len(producers) - NAMED_PER_SOURCE
    return ", ".join(producers[:NAMED_PER_SOURCE]) + (f" and {more} more" if more > 0 else "")


def sizing_text(s: InputStats) -> str:
    """The pool-size estimate at the end of the run, with the sentence that shows its formula."""
    sizing = s.sizing
    if sizing is None or sizing.producers_needed is None:
        return "not estimated: " + (sizing.why if sizing is not None else "no reading")
    return f"{sizing.producers_needed:.2f} -> {sizing.desired_producers} ({sizing.why})"


def served_sources(s: InputStats) -> tuple[str, str]:
    """What the producers serve (``InputStats.producer_sources``) and a warning, "" when none: one dataset,
    ``"webdataset s3://b/laion/index.json (64 producers)"``, when every producer that named one agrees; several,
    each with the producers serving it (the most served first), and the warning naming them."""
    by_source: dict[str, list[str]] = {}
    for producer, source in sorted(s.producer_sources.items()):
        by_source.setdefault(source, []).append(producer)
    if not by_source:
        return "not named (no batch yet, or producers of an older release)", ""
    if len(by_source) == 1:
        (source, producers), = by_source.items()
        return f"{source} ({len(producers)} producer{'s' if len(producers) != 1 else ''})", ""
    text = "; ".join(f"{source}: {_named(producers)}"
                     for source, producers in sorted(by_source.items(), key=lambda kv: (-len(kv[1]), kv[0])))
    return text, (f"producers serve {len(by_source)} different datasets ({text}): every batch mixes them; if that "
                  "is not meant, start every producer with the same --data")


@dataclass
class TrainReport:
    """What a run measured, after the warm-up steps (tracing, pre-fill) are excluded.

    A run that ends within its warm-up (an exact run over a short epoch) has nothing after
    it: then ``seconds`` and ``images_per_s`` cover the whole run, tracing included, and
    ``includes_warmup`` says so (the summary and the report too). ``stats_at_start`` is the input's
    stats when that clock started: each producer's images/s is over the same ``seconds``.
    """

    steps: int
    seconds: float
    images_per_s: float
    mean_queue_occupancy: float
    final_loss: float
    final_accuracy: float
    input_stats: InputStats = field(default_factory=InputStats)
    timeline: Optional[Timeline] = None
    includes_warmup: bool = False
    stats_at_start: InputStats = field(default_factory=InputStats)
    report_path: Optional[str] = None  # where the HTML report was written, if it was
    logdir: Optional[str] = None  # where the TensorBoard logs went, if anywhere

    @property
    def rate_label(self) -> str:
        return "images/s (whole run, warm-up included)" if self.includes_warmup else "images/s (after warm-up)"

    def producers(self) -> list[ProducerTally]:
        """Per producer that sent a batch: batches and images received over the whole run, and images/s over
        the timed ``seconds`` (images received in them / ``seconds``, the window of ``images_per_s``)."""
        return producer_tallies(self.input_stats, self.stats_at_start, self.seconds)

    def producer_lines(self) -> list[str]:
        """One line per producer (``producers()``), then one for connected producers that sent nothing."""
        silent = silent_producers(self.input_stats)
        return [t.line() for t in self.producers()] + (
            [f"{silent} more connected producer(s): 0 batches (a producer is named by its first batch)"]
            if silent else [])

    def bottleneck(self) -> str:
        """One sentence: which side limited training, judged by queue occupancy (``verdict.bottleneck_verdict``)."""
        return bottleneck_verdict(self.mean_queue_occupancy, self.input_stats.stage_seconds)

    def facts(self) -> dict[str, str]:
        """The run's key figures, for the report's table."""
        s = self.input_stats
        served, mixed = served_sources(s)
        return {"steps": str(self.steps), self.rate_label: f"{self.images_per_s:.0f}",
                "dataset served": f"warning: {mixed}" if mixed else served,
                "mean queue occupancy": f"{self.mean_queue_occupancy:.2f}",
                f"batches received per producer (images/s over the timed {self.seconds:.1f} s)":
                    "; ".join(self.producer_lines()) or "none",
                "batches rejected": str(s.protocol_errors + s.mismatched_batches),
                "producers whose shards overlap": (f"{s.shard_conflicts} pair(s): {s.last_shard_conflict}"
                                                   if s.shard_conflicts else "none"),
                "stuck or slow producers": liveness_text(s) if has_liveness_events(s) else "none",
                f"records received per epoch ({RECEIVED_NOT_TRAINED})":
                    (("per shard, each producer counting its own shard's epochs: " if per_shard(s) else "")
                     + coverage_text(s.coverage) + untracked_text(s)) if s.coverage
                    else "not known (no stream in the headers)",
                "producers needed (consumer/sizing)": sizing_text(s),
                "final loss / accuracy": f"{self.final_loss:.3f} / {self.final_accuracy:.2f}",
                "how step times were taken": "waiting for each step's result (a sync per step; staging still "
                                             "runs ahead, a step's dispatch no longer overlaps the previous one)"}

    def summary(self) -> str:
        s = self.input_stats
        served, mixed = served_sources(s)
        return "\n".join([
            f"trained {self.steps} steps in {self.seconds:.1f} s: {self.images_per_s:.0f} images/s"
            + (" (timed from the first step, tracing and pre-fill included: the run did not outlast its warm-up)"
               if self.includes_warmup else ""),
            f"mean queue occupancy: {self.mean_queue_occupancy:.2f}",
            f"final loss {self.final_loss:.3f}, accuracy {self.final_accuracy:.2f}",
            f"batches received: {s.batches:,}, rejected: {s.protocol_errors + s.mismatched_batches}; per producer "
            f"(batches and images over the whole run, images/s over the {self.seconds:.1f} s timed above):",
            *(f"  {line}" for line in self.producer_lines() or ["none"]),
            f"warning: {mixed}" if mixed else f"source: {served}",
            *([f"warning: {s.shard_conflicts} pair(s) of producers whose shards overlap: {s.last_shard_conflict}"]
              if s.shard_conflicts else []),
            *([f"producer pool: {s.connected_producers} connected now ({s.pool_size} address(es)); "
               f"{s.producers_joined} joined (those at the start included) and {s.producers_left} left during the "
               "run"] if s.producers_joined or s.producers_left else []),
            *([f"stuck or slow producers: {liveness_text(s)}"] if has_liveness_events(s) else []),
            *coverage_summary(s),
            f"bottleneck: {self.bottleneck()}",
            f"producers needed: {sizing_text(s)}",
        ])

    def written(self) -> list[str]:
        """Where the run's outputs went, one line each: the HTML report and the TensorBoard logs, if written."""
        return ([f"report (HTML): {self.report_path}"] if self.report_path else []) + (
            [f"TensorBoard logs: {self.logdir} (tensorboard --logdir {self.logdir})"] if self.logdir else [])
