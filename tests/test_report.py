"""The bottleneck report: written by `stoker train --report` and `stoker doctor --report` from real runs,
opened in a real headless Chromium, and its plots checked in the DOM and on a screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.producer.process import ProducerProcess

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


def _stoker(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_stoker_train_report_opens_in_a_browser_with_every_plot_drawn(synth_lmdb, tmp_path):
    report = tmp_path / "train.html"
    with ProducerProcess(synth_lmdb, extra_args=ARGS) as producer:
        # More steps than the queue holds: some batches arrive after the timeline starts, so stage times exist.
        out = _stoker("train", "--connect", producer.endpoint, "--model", "small-cnn", "--batch-size", "8",
                      "--image-size", "32", "--classes", "4", "--steps", "30", "--queue-capacity", "4",
                      "--no-progress", "--report", str(report))
    assert out.returncode == 0, out.stderr[-3000:]
    charts = _check_in_browser(report, tmp_path)
    assert re.search(r"(input|training)-bound|balanced", charts.verdict), charts.verdict
    step_chart = next(c for c in charts.charts if "Step time" in c["title"])
    assert step_chart["points"] == 30, step_chart  # one point per step


def test_stoker_doctor_report_has_the_verdict_and_the_timeline(synth_lmdb, tmp_path):
    report = tmp_path / "doctor.html"
    with ProducerProcess(synth_lmdb, extra_args=ARGS) as producer:
        out = _stoker("doctor", "--connect", producer.endpoint, "--model", "small-cnn", "--batch-size", "8",
                      "--image-size", "32", "--classes", "4", "--steps", "3", "--seconds", "1",
                      "--report", str(report), "--report-steps", "60")
    assert out.returncode == 0, out.stderr[-3000:]
    verdict = next(line for line in out.stdout.splitlines() if line.startswith("verdict: "))
    charts = _check_in_browser(report, tmp_path)
    assert verdict.removeprefix("verdict: ") in " ".join(charts.verdict.split())
