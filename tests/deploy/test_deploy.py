"""Deployment files: compose and manifests validate, Dockerfiles lint, and every command they run parses."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from stoker.cli.main import build_parser

from conftest import installed_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = sorted((DEPLOY / "k8s").rglob("*.yaml"))  # object-storage/ too


def _parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`stoker {' '.join(argv)}` is not a valid stoker command line") from exc


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.object-storage.yml"])
def test_compose_file_is_valid(name):
    out = subprocess.run([installed_tool("docker-compose"), "-f", str(DEPLOY / name), "config", "-q"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_object_storage_variant_has_no_data_volume_and_bounds_each_producers_cache():
    services = yaml.safe_load((DEPLOY / "docker-compose.object-storage.yml").read_text())["services"]
    for name in ("producer-0", "producer-1"):
        argv = services[name]["command"]
        _parses(argv)
        assert argv[argv.index("--lmdb") + 1].startswith("s3://") and "volumes" not in services[name]
        assert "--cache-size" in argv
    for name in ("dataset", "upload", "trainer"):
        _parses(services[name]["command"])
    manifests = list(yaml.safe_load_all((DEPLOY / "k8s" / "object-storage" / "producers.yaml").read_text()))
    assert {d["kind"] for d in manifests} == {"Secret", "Service", "StatefulSet"}
    pod = next(d for d in manifests if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["cache", "dshm"] and pod["volumes"][0]["emptyDir"]["sizeLimit"]


def test_dockerfiles_pass_hadolint():
    out = subprocess.run([installed_tool("hadolint"), *map(str, DEPLOY.glob("*.Dockerfile"))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kubernetes_manifests_validate_against_the_schemas():
    out = subprocess.run([installed_tool("kubernetes-validate"), "--strict", *map(str, K8S)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") >= 4


def test_every_compose_command_is_a_valid_stoker_command_line():
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    commands = {name: s["command"] for name, s in services.items()
                if "command" in s and s.get("image", "").startswith("stoker-")}
    assert set(commands) == {"dataset", "producer-0", "producer-1", "trainer"}
    for argv in commands.values():
        _parses(argv)
    # The trainer connects to the producers by service name on the port they bind.
    connect = commands["trainer"][commands["trainer"].index("--connect") + 1]
    assert connect == "tcp://producer-0:5555,tcp://producer-1:5555"


def test_every_manifest_command_is_a_valid_stoker_command_line():
    containers = []
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            containers += spec.get("containers", [])
    assert {c["name"] for c in containers} == {"producer", "trainer"}
    for c in containers:
        env = {e["name"]: e.get("value", "1") for e in c.get("env", [])}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
        _parses(argv)


def test_the_kubernetes_pool_is_elastic_a_headless_service_the_trainer_follows_and_an_autoscaler_scales():
    docs = [d for path in K8S for d in yaml.safe_load_all(path.read_text())]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "stoker-producer")
    assert service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    producer = next(d for d in docs if d["kind"] == "StatefulSet")
    args = producer["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--shard") + 1] == "auto"
    trainer = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert trainer[trainer.index("--connect") + 1] == f"tcp://{service['metadata']['name']}:5555"
    assert "--exact" in trainer and "--discover-every" in trainer
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": producer["metadata"]["name"]}
