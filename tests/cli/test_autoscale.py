"""``stoker cluster --autoscale``'s controller: real metrics endpoints serving given gauges, one policy on an
injected clock, a real pool of producer processes on loopback (``ScaledPool`` knows nothing of namespaces)."""

import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from conftest import one_worker_producer, unused_port
from stoker.cli.cluster.autoscale import Autoscaler, ScrapeError, TrainerScraper, scrape_needed
from stoker.cli.cluster.autoscaled import AutoscaleLoop, AutoscaleOptions, interrupt_once
from stoker.cli.cluster.local_cluster import ClusterError, check_available
from stoker.cli.cluster.scaled_pool import ScaledPool
from stoker.cli.exit_codes import EXIT_INTERRUPTED
from stoker.consumer.sizing import PRODUCERS_NEEDED_METRIC
from stoker.consumer.sizing.policy import SizingPolicy


class Trainer:
    """A real HTTP metrics endpoint serving a trainer's need (None: the gauge left out, as a trainer that does
    not know yet), or raw bytes, or (``trickle``) a comment line every 50 ms for 20 s."""

    def __init__(self, need=None, raw=None, trickle=False):
        self.registry = CollectorRegistry()
        self.gauge = Gauge(PRODUCERS_NEEDED_METRIC, "need", registry=self.registry)
        self.need, self.raw, self.trickle = need, raw, trickle
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = owner.raw if owner.raw is not None else self._page()
                self.send_response(200)
                self.end_headers()
                for _ in range(400 if owner.trickle else 0):
                    self.wfile.write(b"# still coming\n")
                    self.wfile.flush()
                    time.sleep(0.05)
                self.wfile.write(body)

            def _page(self):
                if owner.need is None:
                    return b"# no reading yet\n"
                owner.gauge.set(owner.need)
                return generate_latest(owner.registry)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trainers():
    made = []
    yield lambda *a, **kw: made.append(Trainer(*a, **kw)) or made[-1]
    for t in made:
        t.close()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_scrape_reads_the_need_and_refuses_what_is_not_a_trainer_page(trainers):
    assert scrape_needed(trainers(1.25).url) == pytest.approx(1.25)
    assert scrape_needed(trainers(None).url) is None  # the trainer does not know yet: not an error
    with pytest.raises(ScrapeError, match="not Prometheus text format"):
        scrape_needed(trainers(raw=b"\x00\xff not { metrics").url)
    with pytest.raises(ScrapeError, match="finite number"):
        scrape_needed(trainers(raw=f"{PRODUCERS_NEEDED_METRIC} NaN\n".encode()).url)
    with pytest.raises(ScrapeError, match="is `--metrics-port` set"):
        scrape_needed(f"http://127.0.0.1:{unused_port()}/metrics", timeout_s=2)


def test_only_http_metrics_urls_are_read_refused_before_any_host_is_made(tmp_path):
    page = tmp_path / "metrics"
    page.write_text(f"{PRODUCERS_NEEDED_METRIC} 2\n")  # a page that parses: refused for its scheme, not its text
    for url in (page.as_uri(), "ftp://127.0.0.1/metrics", "127.0.0.1:9400/metrics"):
        with pytest.raises(ValueError, match="only http:// or https://.*--metrics-port"):
            AutoscaleOptions(metrics=(url,))
        with pytest.raises(ValueError, match="only http:// or https://"):
            TrainerScraper([url])
        with pytest.raises(ScrapeError, match="only http:// or https://"):
            scrape_needed(url)
    AutoscaleOptions(metrics=("http://10.0.0.2:9400/metrics", "HTTPS://trainer/metrics"))


def test_a_page_that_trickles_in_is_cut_at_the_scrape_deadline(trainers):
    # A line every 50 ms never trips urllib's per-read timeout; only the scrape's own deadline ends it.
    with pytest.raises(ScrapeError, match="still arriving at the scrape's deadline"):
        scrape_needed(trainers(1.0, trickle=True).url, timeout_s=0.5)


def test_the_needs_of_several_trainers_are_summed_and_rounded_once(trainers):
    # Three trainers needing 0.3 each: ceil(0.9) = 1 producer for the job, not one each.
    urls = [trainers(0.3).url for _ in range(3)]
    scaler = Autoscaler(TrainerScraper(urls, log=lambda _: None), SizingPolicy(clock=Clock()))
    decision = scaler.step(current=1)
    assert decision.total == pytest.approx(0.9) and decision.desired == 1
    assert "needed sum 0.90" in decision.line() and "hold" in decision.line()


def test_an_unreachable_trainer_is_logged_and_its_last_reading_kept_for_a_bounded_time(trainers):
    clock, lines = Clock(), []
    flaky, steady = trainers(1.6), trainers(0.7)
    scaler = Autoscaler(TrainerScraper([flaky.url, steady.url], stale_after_s=30, clock=clock, log=lines.append),
                        SizingPolicy(down_hold_s=0, clock=clock), clock=clock)
    assert scaler.step(1).desired == 3  # 2.3 -> 3
    flaky.close()
    clock.now += 10
    decision = scaler.step(3)
    assert decision.total == pytest.approx(2.3) and flaky.url in decision.errors
    assert any("keeping its last reading" in line for line in lines)
    clock.now += 25  # 35 s after its last good read: left out, only the steady trainer counts
    decision = scaler.step(3)
    assert decision.needs[flaky.url] is None and decision.total == pytest.approx(0.7)
    assert any("left out of the sum" in line for line in lines)


def test_the_pool_grows_at_once_and_shrinks_after_the_hold_newest_first(trainers, synth_lmdb):
    clock, lines = Clock(), []
    need = trainers(0.5)
    published = []
    pool = ScaledPool(["h0", "h1", "h2"],
                      lambda i: one_worker_producer(synth_lmdb, batch=4, bind="tcp://127.0.0.1:*").__enter__(),
                      published.append, drain_s=5, clock=clock, log=lines.append)
    scaler = Autoscaler(TrainerScraper([need.url], log=lines.append), SizingPolicy(down_hold_s=60, clock=clock),
                        clock=clock)
    loop = AutoscaleLoop(scaler, pool, interval_s=5, clock=clock, log=lines.append, keep_decisions=2)
    try:
        loop.tick()
        assert pool.addresses() == ["h0"]
        need.need = 2.4  # up: at the next decision, no hold
        clock.now += 5
        loop.tick()
        assert pool.addresses() == ["h0", "h1", "h2"] and published[-1] == ["h0", "h1", "h2"]
        assert any("needed sum 2.40" in line and "scale up to 3" in line for line in lines)
        need.need = 0.8  # down: not before the need stayed below for the hold
        for _ in range(12):  # first seen below at 1015; held through 1070
            clock.now += 5
            loop.tick()
            assert pool.size == 3, clock.now
        clock.now += 5  # 60 s below: down
        loop.tick()
        assert pool.addresses() == ["h0"] and published[-1] == ["h0"]  # the newest left first, h0 stays
        assert any("scale down to 1" in line for line in lines)
        gone = pool.producers[1:]
        assert all(p.proc.poll() is None for p in gone)  # draining: still serving what it has
        clock.now += 5
        loop.tick()
        assert all(p.proc.poll() is not None for p in gone) and pool.draining() == 0
        assert "1 data host(s) in the pool, 0 draining" in loop.status()
        # Three logged (the first, up, down); the record keeps the last two, bounded however long the run.
        assert loop.decisions_logged == 3 and [d.target for d in loop.decisions] == [3, 1]
    finally:
        pool.close()


def test_the_first_signal_interrupts_and_no_later_one_cuts_the_teardown_short(capfd):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with interrupt_once() as guard:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            signal.raise_signal(signal.SIGTERM)  # real signals: the handler runs before raise_signal returns
        signal.raise_signal(signal.SIGTERM)  # the teardown goes on
        signal.raise_signal(signal.SIGINT)
    assert capfd.readouterr().err.count("during the teardown: ignored") == 2
    with interrupt_once() as guard:
        guard.tearing_down = True  # a run that ended on its own, tearing down: not even the first interrupts
        signal.raise_signal(signal.SIGINT)
    assert "SIGINT during the teardown: ignored" in capfd.readouterr().err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _stop(proc):
    """A cluster left running by a failed test: SIGTERM first (its teardown deletes its namespaces), bounded, then
    SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _cluster_missing():
    try:
        check_available()
    except ClusterError as exc:
        return str(exc)
    return None


def test_stoker_cluster_autoscale_scales_up_then_down_mid_run_and_every_record_comes_once(trainers, synth_lmdb,
                                                                                         tmp_path):
    """The CLI end to end, the need given by a metrics endpoint this test controls: 2.5 until the trainer has
    stepped (3 producers, at once), then 0.3 (down to 1 after the hold, drained): every epoch exactly once.

    Why the scale-down lands mid-run, by construction and not by a margin: each producer's one worker makes
    150 samples, then waits at a gate (``fixed_supply_pipeline``'s ``gate``/``hold_after``) that this test opens
    only once it has read "scale down to 1". Three producers make at most 450 records before that, fewer than the
    run's 768, so the run cannot end first; one producer alone makes the 100 records the first step line (step 50,
    batches of 2) needs, so the line that triggers the scale-down always comes. The gate gives up after 120 s (said
    in the log), so a failure here is a failed assertion, not a hang. The scale-up comes first because the
    controller decides at its first tick, before the trainer it starts has made a step."""
    missing = _cluster_missing()
    if missing:
        pytest.skip(missing)
    need = trainers(2.5)
    pipeline = Path(__file__).parents[2] / "benchmarks" / "fixed_supply_pipeline.py"
    gate = tmp_path / "scaled-down"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli.main", "cluster", "--lmdb", str(synth_lmdb), "--autoscale",
         "--autoscale-metrics", need.url, "--max-producers", "3", "--autoscale-interval", "1",
         "--autoscale-down-hold", "2", "--epochs", "8", "--steps", "100000", "--batch-size", "2",
         "--image-size", "32", "--queue-capacity", "2", "--workers", "1", "--pipeline", f"{pipeline}:make_pipeline",
         "--pipeline-arg", "sample_s=0.05", "--pipeline-arg", "images_px=32", "--pipeline-arg", f"gate={gate}",
         "--pipeline-arg", "hold_after=150"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "trainer: " in line and " step=" in line and any("scale up to 3" in seen for seen in lines):
                need.need = 0.3
            if "scale down to 1" in line:
                gate.touch()
        assert proc.wait(60) == 0, "".join(lines[-60:])
    finally:
        _stop(proc)
    out = "".join(lines)
    assert "pool 1, desired 3: scale up to 3" in out and "desired 1: scale down to 1" in out, out[-4000:]
    assert out.index("scale up to 3") < out.index(" step=") < out.index("scale down to 1"), out[-4000:]
    assert "  epochs 0-7 (8 epochs): 96/96 records each (100.0%), none seen more than once\n" in out, out[-4000:]
    assert "going on without it" not in out, out[-4000:]  # the gate held until the scale-down, as designed


def test_sigterm_stops_an_autoscaled_cluster_and_tears_it_down(trainers, synth_lmdb):
    """SIGTERM mid-run (right after a scale-up) ends the controller and the run through the teardown: interrupted,
    its producers stopped and counted, its namespaces deleted, though a second SIGTERM comes during the teardown."""
    missing = _cluster_missing()
    if missing:
        pytest.skip(missing)
    need = trainers(1.5)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli.main", "cluster", "--lmdb", str(synth_lmdb), "--autoscale",
         "--autoscale-metrics", need.url, "--max-producers", "2", "--autoscale-interval", "1", "--steps", "100000",
         "--batch-size", "4", "--image-size", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "scale up to 2" in line:
                proc.send_signal(signal.SIGTERM)
            if "producers (each daemon's own count" in line:  # tearing down: a second one must not cut it short
                proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        _stop(proc)
    out = "".join(lines)
    assert code == EXIT_INTERRUPTED and "stoker cluster: interrupted" in out, out[-3000:]
    assert "producers (each daemon's own count at its stop):" in out, out[-3000:]
    tags = set(re.findall(r"namespace (stk[0-9a-f]+)-", out))
    assert tags, out[-3000:]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not [ns for ns in namespaces.split() if ns.split("-")[0] in tags], namespaces
