"""The Grafana dashboard and the compose `monitoring` profile: every query names what Stoker really exports.

The metrics are scraped over HTTP from a real producer daemon and a real ZMQInput
that received batches from it, so a renamed metric or label fails here, not on a
user's empty panel.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections import defaultdict
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stoker.consumer import ZMQInput
from stoker.producer.process import ProducerProcess

from conftest import installed_tool, promql_selectors, unused_port

pytestmark = pytest.mark.timeout(120)
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
# Grafana's own variables, replaced by what Grafana would put there before the query is parsed.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "30m"}


def _scrape(url: str) -> dict[str, set[str]]:
    """Sample name -> label names, from a real /metrics endpoint."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    labels: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels[sample.name] |= set(sample.labels)
    return labels


@pytest.fixture(scope="module")
def exported(synth_lmdb) -> dict[str, set[str]]:
    port = unused_port()
    args = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--metrics-port", str(port), "--id", "p0"]
    with ProducerProcess(synth_lmdb, extra_args=args) as producer, \
            ZMQInput([producer.endpoint], batch_size=8, image_shape=(32, 32, 3), recv_timeout=30) as inp:
        trainer_port = inp.serve_metrics(0)
        for _ in range(3):
            inp.get()  # per-producer series exist once batches arrived
        metrics = _scrape(f"http://127.0.0.1:{port}/metrics")
        metrics.update(_scrape(f"http://127.0.0.1:{trainer_port}/metrics"))
    return metrics


def _queries(dashboard: Path) -> list[str]:
    panels = json.loads(dashboard.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def _check(node, exported: dict[str, set[str]], expr: str) -> None:
    """Metric names, matcher labels and ``by`` labels of ``node`` all exist in ``exported``."""
    selectors = promql_selectors(node)
    assert selectors, f"{expr!r} reads no metric"
    for selector in selectors:
        assert selector.name in exported, f"{expr!r} reads {selector.name!r}, which Stoker does not export"
        for matcher in selector.matchers.matchers:
            assert matcher.name in exported[selector.name], \
                f"{expr!r} matches label {matcher.name!r}, which {selector.name} does not have"
    if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
        available = set.intersection(*(exported[s.name] for s in selectors))
        missing = set(node.modifier.labels) - available
        assert not missing, f"{expr!r} groups by {sorted(missing)}, which its metrics do not have"
    for attr in ("lhs", "rhs", "expr"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (promql_parser.VectorSelector, promql_parser.MatrixSelector)):
            _check(child, exported, expr)
    for arg in getattr(node, "args", None) or []:
        if not isinstance(arg, (promql_parser.VectorSelector, promql_parser.MatrixSelector)):
            _check(arg, exported, expr)


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_names_a_metric_and_labels_stoker_exports(dashboard, exported):
    queries = _queries(dashboard)
    assert len(queries) >= 8
    for expr in queries:
        text = expr
        for variable, value in GRAFANA_VARIABLES.items():
            text = text.replace(variable, value)
        _check(promql_parser.parse(text), exported, expr)
    read = {s.name for expr in queries for s in promql_selectors(promql_parser.parse(
        expr.replace("$__rate_interval", "1m").replace("$__range", "30m")))}
    # What the issue asks the dashboard to show, at least.
    for metric in ("stoker_trainer_queue_occupancy", "stoker_producer_images_sent_total",
                   "stoker_producer_records_skipped_total", "stoker_trainer_protocol_errors_total",
                   "stoker_producer_stage_seconds_total"):
        assert metric in read, f"the dashboard does not show {metric}"


def test_the_checker_rejects_an_unknown_metric_and_an_unknown_label(exported):
    with pytest.raises(AssertionError, match="does not export"):
        _check(promql_parser.parse("rate(stoker_producer_images_sent[1m])"), exported, "x")  # no _total
    with pytest.raises(AssertionError, match="groups by"):
        _check(promql_parser.parse("sum by (stage) (rate(stoker_producer_images_sent_total[1m]))"), exported, "x")
    with pytest.raises(AssertionError, match="matches label"):
        _check(promql_parser.parse('stoker_trainer_queue_occupancy{producer="p0"}'), exported, "x")


def test_the_monitoring_profile_provisions_prometheus_scraping_every_metrics_port_and_grafana():
    compose = DEPLOY / "docker-compose.yml"
    out = subprocess.run([installed_tool("docker-compose"), "-f", str(compose), "--profile", "monitoring", "config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert {"prometheus", "grafana"} <= set(services)
    # Optional: only `--profile monitoring` starts them, and nothing else needs them.
    # (docker-compose 1.x `config --services` lists every profile, so the file itself is checked.)
    for name, service in services.items():
        if name in ("prometheus", "grafana"):
            assert service.get("profiles") == ["monitoring"], f"{name} must be in the monitoring profile only"
        else:
            assert not service.get("profiles"), name
            assert not {"prometheus", "grafana"} & set(service.get("depends_on") or {}), f"{name} needs monitoring"
    # Every mounted file or folder exists in the repository.
    for name in ("prometheus", "grafana"):
        for volume in services[name].get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            assert Path(source).exists(), f"{name} mounts {source}, which does not exist"
    # Prometheus scrapes each Stoker service on the port it serves metrics on.
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    expected = set()
    for name, service in services.items():
        command = service.get("command") or []
        if "--metrics-port" in command:
            expected.add(f"{name}:{command[command.index('--metrics-port') + 1]}")
    assert expected and targets == expected
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    for dashboard in DASHBOARDS:
        for panel in json.loads(dashboard.read_text())["panels"]:
            assert panel["datasource"]["uid"] == uid, f"panel {panel['title']!r} uses another datasource"
