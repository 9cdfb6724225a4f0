"""The bottleneck report: written by `stoker train --report` and `stoker doctor --report` from real runs,
opened in a real headless Chromium, and its plots checked in the DOM and on a screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.producer.process import ProducerProcess

from conftest import stoker_cli

pytestmark = pytest.mark.timeout(300)
ARGS = ["--workers", "1", "--batch-size", "8", "--image-size", "32"]
CHARTS = ("Queue occupancy", "Step time", "Images/s received per producer", "time per image, by stage")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    if os.environ.get("CI"):
        pytest.fail("Chromium is not installed; .ci/run installs it (Debian package `chromium`)")
    pytest.skip("Chromium not installed (.ci/run installs it)")


def _browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args],
                          capture_output=True, text=True, timeout=120)


class _Charts(HTMLParser):
    """Each ``<svg class="chart">`` in a DOM: its title and how many series elements it draws."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: list[dict] = []
        self.verdict = ""
        self._in_verdict = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "svg" and a.get("class") == "chart":
            self.charts.append({"title": a.get("data-title", ""), "series": 0, "points": 0})
        elif tag in ("polyline", "circle") and a.get("class") == "series" and self.charts:
            self.charts[-1]["series"] += 1
            self.charts[-1]["points"] += len(a.get("points", "").split()) if tag == "polyline" else 1
        elif tag == "p" and a.get("class") == "verdict":
            self._in_verdict = True

    def handle_data(self, data: str) -> None:
        if self._in_verdict:
            self.verdict += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "p":
            self._in_verdict = False


def _check_in_browser(report: Path, tmp_path: Path) -> _Charts:
    """Load the report in headless Chromium: every chart has plotted series and the page is not blank."""
    dom = _browser(tmp_path, "--dump-dom", report.as_uri())
    assert dom.returncode == 0 and "<svg" in dom.stdout, dom.stderr[-2000:]
    charts = _Charts()
    charts.feed(dom.stdout)
    for wanted in CHARTS:
        found = [c for c in charts.charts if wanted in c["title"]]
        assert found, f"no chart {wanted!r} in the rendered page: {[c['title'] for c in charts.charts]}"
        assert all(c["series"] >= 1 and c["points"] >= 1 for c in found), f"chart {wanted!r} plots nothing: {found}"
    shot = tmp_path / "report.png"
    out = _browser(tmp_path, f"--screenshot={shot}", "--window-size=900,1600", report.as_uri())
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    inked = (pixels < 235).any(axis=2).mean()  # not white
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7].tolist()}
    assert inked > 0.01, f"the screenshot is (nearly) blank: {inked:.4f} of pixels not white"
    assert len(colours) > 20, f"the screenshot has only {len(colours)} colours: the charts did not draw"
    return charts


def test_stoker_train_report_opens_in_a_browser_with_every_plot_drawn(synth_lmdb, tmp_path):
    report, logdir = tmp_path / "train.html", tmp_path / "tensorboard"
    with ProducerProcess(synth_lmdb, extra_args=ARGS) as producer:
        # More steps than the queue holds: some batches arrive after the timeline starts, so stage times exist.
        out = stoker_cli("train", "--connect", producer.endpoint, "--model", "small-cnn", "--batch-size", "8",
                         "--image-size", "32", "--classes", "4", "--steps", "30", "--queue-capacity", "4",
                         "--no-progress", "--report", str(report), "--logdir", str(logdir), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    charts = _check_in_browser(report, tmp_path)
    assert re.search(r"(input|training)-bound|balanced", charts.verdict), charts.verdict
    step_chart = next(c for c in charts.charts if "Step time" in c["title"])
    assert step_chart["points"] == 30, step_chart  # one point per step
    # Issue 31.10: the summary says where the report and the TensorBoard logs went ...
    assert f"report (HTML): {report}\n" in out.stdout and any(logdir.iterdir()), out.stdout
    assert f"TensorBoard logs: {logdir} (tensorboard --logdir {logdir})\n" in out.stdout, out.stdout
    # ... and that the records per epoch are what the input received, queued batches too, not what was trained
    # on (240 records trained on here, more received); one producer on shard 0/1: whole-dataset epochs.
    received = "records received per epoch (by the input: batches still queued or pre-filled count too, not only " \
               "those trained on"
    whole = r"; the latest may be in progress\): epoch 0: 96/96 \(100%\), epoch 1: 96/96"
    assert re.search(re.escape(received) + whole, out.stdout), out.stdout
    assert f"<td>{received})</td><td class='value'>epoch 0: 96/96 (100%), epoch 1: 96/96" in report.read_text()
    # The dataset served, named by the producer's batch headers (issue 42), in the summary and the report.
    assert f"\nsource: lmdb {synth_lmdb} (1 producer)\n" in out.stdout, out.stdout
    assert f"<td>dataset served</td><td class='value'>lmdb {synth_lmdb} (1 producer)</td>" in report.read_text()
    # How many producers the job needs (issue 43): estimated, or why not yet, in both.
    assert re.search(r"\nproducers needed: ([0-9.]+ -> \d+ \(the step takes|not estimated: )", out.stdout), out.stdout
    assert "<td>producers needed (consumer/sizing)</td>" in report.read_text()


def test_the_summary_gives_the_producers_needed_with_the_formula_that_made_the_number():
    from stoker.consumer.receive.input_stats import InputStats
    from stoker.consumer.sizing.pool_sizing import PoolSizer
    from stoker.consumer.train.run_summary import TrainReport

    now = [0.0]
    sizer = PoolSizer(batch_size=10, headroom=0.15, clock=lambda: now[0])
    sizer.demand.time_waits()
    for i in range(1, 61):  # 6 s at 10 batches/s, waiting a fifth of the time
        sizer.demand.begin_wait()
        now[0] = i * 0.1 - 0.08
        sizer.demand.end_wait()
        now[0] = i * 0.1
        sizer.demand.sample(i, 0)
    sizer.supply.batch("p0", 0, 50, {"decode": 1.0})  # 50 images/s per producer
    sizing = sizer.update(pool_producers=2)
    report = TrainReport(steps=3, seconds=2.0, images_per_s=12.0, mean_queue_occupancy=0.1, final_loss=1.0,
                         final_accuracy=0.5, input_stats=InputStats(sizing=sizing))
    # 100 images/s consumed in 80% of the time: 125 when not waiting, x 1.15 / 50 = 2.875 -> 3 (2.87: the window
    # begins inside the first wait)
    assert "producers needed: 2.87 -> 3 (the step takes 125 images/s when not waiting (input-bound, waiting 20% " \
           "of the time); a producer makes 50 images/s (mean of 1); x 1.15 headroom: 2.87 producers -> 3, the pool " \
           "has 2)" in report.summary(), report.summary()
    assert TrainReport(steps=1, seconds=1.0, images_per_s=1.0, mean_queue_occupancy=0.0, final_loss=0.0,
                       final_accuracy=0.0).facts()["producers needed (consumer/sizing)"] == "not estimated: no reading"


def test_the_summary_and_report_give_coverage_per_shard_where_each_producer_counts_its_shards_epochs():
    from stoker.consumer.receive.input_stats import InputStats
    from stoker.consumer.train.run_summary import TrainReport

    stats = InputStats(coverage={("0/2", 262): (32, 32), ("0/2", 263): (5, 32), ("1/2", 270): (32, 32),
                                 ("1/2", 271): (1, 32)})
    report = TrainReport(steps=3, seconds=2.0, images_per_s=12.0, mean_queue_occupancy=0.5, final_loss=1.0,
                         final_accuracy=0.5, input_stats=stats)
    lines = report.summary().splitlines()
    at = lines.index("records received per shard and epoch (each producer counts its own shard's epochs; by the "
                     "input: batches still queued or pre-filled count too, not only those trained on; each shard's "
                     "latest epoch may be in progress):")
    assert lines[at + 1:at + 3] == ["  shard 0/2, epoch 262: 32/32 (100%), epoch 263: 5/32 (16%)",
                                    "  shard 1/2, epoch 270: 32/32 (100%), epoch 271: 1/32 (3%)"]
    fact = next(v for k, v in report.facts().items() if k.startswith("records received per epoch (by the input"))
    assert fact == ("per shard, each producer counting its own shard's epochs: shard 0/2, epoch 262: 32/32 (100%), "
                    "epoch 263: 5/32 (16%); shard 1/2, epoch 270: 32/32 (100%), epoch 271: 1/32 (3%)")
    assert report.written() == []  # no report, no TensorBoard logs: nothing to point at
    report.input_stats.coverage_untracked_batches = 3  # shards past Coverage's bounds: said, not hidden
    assert "; 3 batch(es) of shards past the number tracked not counted):" in report.summary()


def test_producers_serving_different_datasets_are_named_in_a_warning():
    from stoker.consumer.receive.input_stats import InputStats
    from stoker.consumer.train.run_summary import TrainReport

    sources = {f"p{i:02d}": "webdataset s3://b/laion/index.json" for i in range(10)}
    sources.update({"odd1": "parquet /data/hf/index.json", "odd0": "parquet /data/hf/index.json"})
    report = TrainReport(steps=3, seconds=2.0, images_per_s=12.0, mean_queue_occupancy=0.5, final_loss=1.0,
                         final_accuracy=0.5, input_stats=InputStats(producer_sources=sources))
    mixed = ("producers serve 2 different datasets (webdataset s3://b/laion/index.json: p00, p01, p02, p03, p04, "
             "p05, p06, p07 and 2 more; parquet /data/hf/index.json: odd0, odd1): every batch mixes them; if that is "
             "not meant, start every producer with the same --data")
    assert f"\nwarning: {mixed}\n" in report.summary()
    assert report.facts()["dataset served"] == f"warning: {mixed}"
    report.input_stats = InputStats()  # producers of an older release name nothing: said, not guessed
    assert "\nsource: not named (no batch yet, or producers of an older release)\n" in report.summary()


def test_doctor_advice_fits_the_device_the_step_ran_on():
    import tensorflow as tf

    from stoker.consumer.train.throughput import Diagnosis, training_device

    assert training_device() == ("GPU" if tf.config.list_logical_devices("GPU") else "CPU")
    on_cpu = Diagnosis(900.0, 300.0, 50.0, 2, device="CPU").sentence()
    assert on_cpu.startswith("training-bound") and "GPU or another accelerator" in on_cpu and "bigger GPU" not in on_cpu
    assert "a bigger GPU" in Diagnosis(900.0, 300.0, 50.0, 2, device="GPU").sentence()
    assert "GPU" not in Diagnosis(900.0, 300.0, 50.0, 2).sentence()  # device unknown: no guess


def test_stoker_doctor_report_has_the_verdict_and_the_timeline(synth_lmdb, tmp_path):
    report = tmp_path / "doctor.html"
    with ProducerProcess(synth_lmdb, extra_args=ARGS) as producer:
        out = stoker_cli("doctor", "--connect", producer.endpoint, "--model", "small-cnn", "--batch-size", "8",
                         "--image-size", "32", "--classes", "4", "--steps", "3", "--seconds", "1",
                         "--report", str(report), "--report-steps", "60", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    verdict = next(line for line in out.stdout.splitlines() if line.startswith("verdict: "))
    device = re.search(r"^trainer: \d+ images/s on constant input \(small-cnn, on the (CPU|GPU)\)$", out.stdout, re.M)
    assert device, out.stdout
    if device.group(1) == "CPU":  # issue 31.10: never "a bigger GPU" for a run on the CPU
        assert "GPU" not in verdict or "train on a GPU or another accelerator" in verdict, verdict
    charts = _check_in_browser(report, tmp_path)
    assert verdict.removeprefix("verdict: ") in " ".join(charts.verdict.split())
