"""The Kubernetes autoscaler: the HPA, the prometheus-adapter rule it reads, and the trainer metric behind both.

The schemas are checked by kubernetes-validate (here per Kubernetes version, and in test_deploy.py for every
manifest); the rule's PromQL by promql-parser; the rounding by the HPA's own formula applied to the manifest's
numbers, so a changed target or tolerance fails here, not in a user's cluster.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml

from conftest import installed_tool, promql_selectors

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
HPA_FILE = K8S / "autoscaler.yaml"
#: What the adapter puts for <<.LabelMatchers>> for an HPA in namespace "stoker" with no metric selector.
LABEL_MATCHERS = 'namespace="stoker"'
#: The adapter's rule keys (prometheus-adapter docs/config.md); anything else is a typo it would ignore.
RULE_KEYS = {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}


def _hpas() -> list[dict]:
    return [d for path in sorted(K8S.rglob("*.yaml")) for d in yaml.safe_load_all(path.read_text())
            if d and d.get("kind") == "HorizontalPodAutoscaler"]


def _external_rules() -> list[dict]:
    config_map = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    assert config_map["kind"] == "ConfigMap"
    return yaml.safe_load(config_map["data"]["config.yaml"])["externalRules"]


def _series_read(rule: dict) -> str:
    """The one metric a rule's metricsQuery reads, checked against its seriesQuery and name pattern."""
    query = rule["metricsQuery"]
    assert set(re.findall(r"<<\.(\w+)>>", query)) <= {"LabelMatchers", "Series"}, query
    parsed = promql_parser.parse(query.replace("<<.LabelMatchers>>", LABEL_MATCHERS))
    selectors = promql_selectors(parsed)
    names = {s.name for s in selectors}
    discovered = promql_parser.parse(rule["seriesQuery"]).name
    assert names == {discovered}, f"{query!r} reads {sorted(names)}, but the rule discovers {discovered!r}"
    namespace = LABEL_MATCHERS.split('"')[1]
    assert all(any((m.name, m.value) == ("namespace", namespace) and m.op == promql_parser.MatchOp.Equal
                   for m in s.matchers.matchers) for s in selectors), \
        f"{query!r} drops <<.LabelMatchers>> somewhere: it would sum other namespaces"
    assert re.search(rule["name"].get("matches", ".*"), discovered), f"{rule['name']} does not match {discovered}"
    return discovered


def _hpa_replicas(current: int, needs: list[float], target: str, behavior: dict) -> int:
    """What the HPA asks for: Kubernetes' GetExternalPerPodMetricReplicas (replica_calculator.go) on the values
    the adapter serves (milli-units, truncated), with each direction's tolerance (default 0.1), before the
    behavior's rate limits and stabilization."""
    usage = sum(int(n * 1000) for n in needs)
    target_milli = int(float(target) * 1000)
    ratio = usage / (target_milli * current)
    up, down = (float(behavior.get(d, {}).get("tolerance", 0.1)) for d in ("scaleUp", "scaleDown"))
    if 1 - down <= ratio <= 1 + up:
        return current
    return math.ceil(usage / target_milli)


def test_the_default_hpa_scales_the_producers_on_the_adapters_metric_with_an_average_value_of_one():
    hpas = _hpas()
    assert len(hpas) == 1, "one HPA per StatefulSet: two would fight (the controller marks both AmbiguousSelector)"
    spec = hpas[0]["spec"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    exported = {rule["name"]["as"] for rule in _external_rules()}
    assert metric["external"]["metric"]["name"] in exported, \
        f"the HPA reads {metric['external']['metric']['name']!r}; the adapter exports {sorted(exported)}"
    assert spec["minReplicas"] >= 1 and spec["maxReplicas"] > spec["minReplicas"]


def test_the_adapter_rule_parses_and_sums_the_trainers_need_in_the_hpas_namespace():
    (rule,) = _external_rules()
    assert set(rule) <= RULE_KEYS, f"unknown adapter rule keys {sorted(set(rule) - RULE_KEYS)}"
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert _series_read(rule) == "stoker_trainer_producers_needed"
    parsed = promql_parser.parse(rule["metricsQuery"].replace("<<.LabelMatchers>>", LABEL_MATCHERS))
    # Summed over the trainers at each step, then averaged: see the rule's comment for why in that order.
    assert parsed.func.name == "avg_over_time" and isinstance(parsed.args[0], promql_parser.SubqueryExpr)
    inner = parsed.args[0].expr
    assert isinstance(inner, promql_parser.AggregateExpr) and str(inner.op) == "sum"
    assert inner.modifier is None, "grouped, the sum would be per label value, not the job's"


def test_the_checker_rejects_a_rule_reading_another_series_or_losing_the_namespace():
    (rule,) = _external_rules()
    with pytest.raises(AssertionError, match="but the rule discovers"):
        _series_read({**rule, "metricsQuery": "sum(stoker_desired_producers{<<.LabelMatchers>>})"})
    with pytest.raises(AssertionError, match="drops <<.LabelMatchers>>"):
        _series_read({**rule, "metricsQuery": "sum(stoker_trainer_producers_needed)"})


def test_the_hpa_rounds_the_jobs_summed_need_once_and_tolerates_nothing():
    (hpa,) = _hpas()
    target = hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"]
    behavior = hpa["spec"]["behavior"]
    assert _hpa_replicas(1, [0.3] * 16, target, behavior) == 5  # 16 trainers at 0.3: ceil(4.8), not 16
    assert _hpa_replicas(12, [12.9], target, behavior) == 13  # the default 10% would keep 12
    assert _hpa_replicas(12, [12.9], target, {}) == 12
    assert _hpa_replicas(13, [12.1], target, behavior) == 13  # ceil(12.1) is 13: no change
    assert _hpa_replicas(13, [11.9], target, behavior) == 12
    assert _hpa_replicas(4, [3.0], target, behavior) == 3


def test_the_scale_down_waits_and_hands_producers_back_a_bounded_share_at_a_time():
    (hpa,) = _hpas()
    down, up = hpa["spec"]["behavior"]["scaleDown"], hpa["spec"]["behavior"]["scaleUp"]
    assert down["stabilizationWindowSeconds"] >= 120 > up["stabilizationWindowSeconds"]
    percent = [p for p in down["policies"] if p["type"] == "Percent"]
    assert percent and all(p["value"] < 50 for p in percent), "removing half the pool at once re-serves half its work"


def test_the_tolerance_field_needs_kubernetes_1_33_and_the_documented_fallback_validates_on_older_ones(tmp_path):
    tool = installed_tool("kubernetes-validate")

    def validate(path: Path, version: str) -> subprocess.CompletedProcess:
        return subprocess.run([tool, "--strict", "-k", version, str(path)], capture_output=True, text=True,
                              timeout=60)

    assert validate(HPA_FILE, "1.33.0").returncode == 0
    refused = validate(HPA_FILE, "1.32.0")
    assert refused.returncode != 0 and "tolerance" in refused.stdout + refused.stderr
    # The manifest's own instruction for older clusters: delete the `tolerance:` lines.
    stripped = tmp_path / "autoscaler.yaml"
    stripped.write_text("".join(line for line in HPA_FILE.read_text().splitlines(keepends=True)
                                if not line.lstrip().startswith("tolerance:")))
    out = validate(stripped, "1.25.0")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_adapter_reads_the_metric_the_trainer_exports():
    from stoker.consumer.sizing import PRODUCERS_NEEDED_METRIC as name  # renamed or gone: this fails, never skips

    (rule,) = _external_rules()
    assert _series_read(rule) == name
    collector = (ROOT / "consumer" / "receive" / "metrics.py").read_text()
    assert "PRODUCERS_NEEDED_METRIC" in collector or name in collector, \
        f"consumer/receive/metrics.py does not export {name}"
