"""benchmarks/shard_scale.py on a small scale: the manifest a sharded build writes, parsed and opened, and the pool's
scheduler in epoch orders 2 and 1 serving splits. Keeps the benchmark from rotting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_a_small_shard_scale_run_reports_every_part(tmp_path):
    out = tmp_path / "shard_scale.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shard_scale.py"), "--shards", "20,200",
                           "--shard-records", "500", "--producers", "4", "--cache-shards", "2", "--splits", "12",
                           "--old-shards", "20", "--old-records", "10000", "--tar-shards", "300",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [m["shards"] for m in result["manifests"]] == [20, 200]
    for m in result["manifests"]:
        assert m["manifest_bytes"] > 100 * m["shards"] and m["open_s"] > 0 and m["parse_peak_mib"] > 0
    assert [(t["shards"], t["form"]) for t in result["tar_indexes"]] == [(300, "json"), (300, "compact")]
    assert all(t["parse_s"] > 0 and t["data_bytes"] > 60 * 300 for t in result["tar_indexes"])
    assert [(p["shards"], p["epoch_order"]) for p in result["pools"]] == [(20, 2), (200, 2), (20, 1)]
    for p in result["pools"]:
        assert p["splits_handed"] >= 12 and p["scheduler_us"] > 0 and p["scheduler_mib"] > 0
        assert p["key"].endswith(":o2") == (p["epoch_order"] == 2)
