"""Metrics scraped over real HTTP, `stoker status`, structured logs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stoker.consumer import ZMQInput
from stoker.producer.process import ProducerProcess

from conftest import unused_port

pytestmark = pytest.mark.timeout(120)
ARGS = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--log-interval", "1"]


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix))


def test_producer_and_trainer_metrics_are_scraped_and_status_names_the_bottleneck(synth_lmdb):
    port = unused_port()
    with ProducerProcess(synth_lmdb, extra_args=[*ARGS, "--metrics-port", str(port)]) as producer, \
            ZMQInput([producer.endpoint], batch_size=8, image_shape=(32, 32, 3), recv_timeout=30,
                     queue_capacity=8) as inp:
        trainer_port = inp.serve_metrics(0)
        for _ in range(20):
            inp.get()
        produced = _metrics(f"http://127.0.0.1:{port}/metrics")
        assert _value(produced, "stoker_producer_batches_sent_total") >= 20
        assert _value(produced, "stoker_producer_images_sent_total") >= 160
        assert _value(produced, "stoker_producer_workers_alive") == 1
        assert produced[f"stoker_producer_source_info{sorted({'producer': producer.producer_id, 'kind': 'lmdb', 'location': str(synth_lmdb)}.items())}"] == 1
        assert _value(produced, "stoker_producer_stage_seconds_total[('producer'") > 0
        received = _metrics(f"http://127.0.0.1:{trainer_port}/metrics")
        assert _value(received, "stoker_trainer_batches_received_total") >= 20
        assert received[f"stoker_trainer_producer_source_info{sorted({'producer': producer.producer_id, 'source': f'lmdb {synth_lmdb}'}.items())}"] == 1
        assert _value(received, "stoker_trainer_connected_producers") == 1
        assert "stoker_trainer_queue_occupancy[]" in received
        assert _value(received, "stoker_trainer_protocol_errors_total") == 0
        # Coverage carries its shard (issue 31.1): one producer on shard 0/1 serves the whole dataset, "all";
        # 160 records received of 96, in order (one worker), so epoch 0 is whole.
        assert received["stoker_trainer_epoch_coverage[('epoch', '0'), ('shard', 'all')]"] == 1.0
        # Nobody consumes now, so the queue fills: status must call it training-bound.
        deadline = time.monotonic() + 60
        while inp.queue_size() < inp.queue_capacity:
            assert time.monotonic() < deadline, "the queue never filled"
            time.sleep(0.05)
        out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "status", "--metrics",
                              f"127.0.0.1:{port},http://127.0.0.1:{trainer_port}/metrics", "--interval", "1"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "producer" in out.stdout and "trainer" in out.stdout and "img/s" in out.stdout
        assert "bottleneck: training-bound" in out.stdout


def test_status_names_an_unreachable_url():
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "status", "--metrics", f"127.0.0.1:{unused_port()}",
                          "--interval", "0.1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot read http://127.0.0.1:" in out.stderr


def test_status_shows_the_urls_that_answer_and_marks_the_one_that_is_down(synth_lmdb):
    # Issue 39.11: one departed producer used to hide the rest behind "cannot read http://A/metrics", exit 1.
    from stoker.consumer import BatchStream

    port, gone = unused_port(), f"127.0.0.1:{unused_port()}"  # nothing listens on ``gone``
    with ProducerProcess(synth_lmdb, extra_args=[*ARGS, "--metrics-port", str(port)]) as producer, \
            BatchStream([producer.endpoint], recv_timeout=30) as stream:
        trainer_port = stream.serve_metrics(0)
        next(stream)
        urls = [gone, f"127.0.0.1:{port}", f"127.0.0.1:{trainer_port}"]
        out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "status", "--metrics", ",".join(urls),
                              "--interval", "0.5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"down     {gone}") and f"cannot read http://{gone}/metrics" in lines[0]
    assert lines[1].startswith(f"producer 127.0.0.1:{port}") and "img/s" in lines[1]
    assert lines[2].startswith(f"trainer  127.0.0.1:{trainer_port}") and "img/s" in lines[2]
    assert lines[3].startswith("bottleneck: ") and lines[3].endswith("(1 of 3 URL(s) down)")
    help_text = subprocess.run([sys.executable, "-m", "stoker.cli.main", "status", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "3 some answered" in " ".join(help_text.split())


def test_json_logs_are_one_object_per_line_with_the_rates_as_fields(synth_lmdb, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "stoker.cli.main", "--log-format", "json", "produce", "--lmdb",
                             str(synth_lmdb), "--bind", "tcp://127.0.0.1:*", *ARGS],
                            stderr=subprocess.PIPE, text=True)
    try:
        events = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("images_per_s" in e for e in events):
            events.append(json.loads(proc.stderr.readline()))
    finally:
        proc.terminate()
        proc.wait(10)
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in events)
    rate = next(e for e in events if "images_per_s" in e)
    assert isinstance(rate["images_per_s"], float) and rate["logger"] == "stoker.producer"
