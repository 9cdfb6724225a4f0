"""``stoker bench pool``: one core's rate on the user's own pipeline and data, and the hosts a demand needs."""

from __future__ import annotations

import io
import json
import math
import tarfile

import pytest

from stoker.cli.measure.pool_plan import plan_pool

from conftest import random_jpeg, stoker_cli

pytestmark = pytest.mark.timeout(180)


def test_the_plan_is_demand_with_headroom_over_one_core_in_hosts_of_cores_less_one():
    plan = plan_pool(per_core_images_per_s=400, demand_images_per_s=20_000, cores_per_host=16, headroom=0.15,
                     sample_bytes=224 * 224 * 3)
    assert plan.workers == math.ceil(20_000 * 1.15 / 400) == 58 and plan.workers_per_host == 15 and plan.hosts == 4
    assert plan.supply_images_per_s == 4 * 15 * 400 >= 20_000 * 1.15
    assert plan.gbit_per_s == pytest.approx(20_000 * 150_528 * 8 / 1e9)
    assert plan_pool(400, 100, 16, workers_per_host=4).hosts == 1  # at least one worker, one host
    for bad in ({"per_core_images_per_s": 0}, {"demand_images_per_s": -1}, {"cores_per_host": 0}, {"headroom": -0.1}):
        with pytest.raises(ValueError, match="must be"):
            plan_pool(**{"per_core_images_per_s": 400, "demand_images_per_s": 1000, "cores_per_host": 8, **bad})


def test_bench_pool_measures_an_lmdb_and_plans_for_the_demand(synth_lmdb):
    done = stoker_cli("bench", "pool", "--data", str(synth_lmdb), "--demand", "5000", "--cores-per-host", "8",
                      "--image-size", "32", "--seconds", "0.1", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    per_core = plan["stages"]["pipeline"]
    assert plan["per_core_images_per_s"] == per_core > 0 and plan["sample_bytes"] == 32 * 32 * 3 + 4 + 8 + 4
    assert plan["workers"] == max(1, math.ceil(5000 * 1.15 / per_core - 1e-9))
    assert plan["hosts"] == math.ceil(plan["workers"] / 7)
    table = stoker_cli("bench", "pool", "--data", str(synth_lmdb), "--demand", "5000", "--image-size", "32",
                       "--seconds", "0.1")
    assert table.returncode == 0 and "hosts of 16 cores" in table.stdout and "decode workers" in table.stdout


def test_bench_pool_reads_a_webdataset_index_in_place(tmp_path):
    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "000000.tar", "w") as tar:
        for i in range(12):
            for ext, data in (("jpg", random_jpeg(i, (40, 48, 3))), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    index = tmp_path / "index.json"
    built = stoker_cli("data", "index", "--webdataset", str(tars / "000000.tar"), "--out", str(index), "--quiet")
    assert built.returncode == 0, built.stderr
    done = stoker_cli("bench", "pool", "--data", str(index), "--demand", "1000", "--image-size", "32", "--seconds",
                      "0.1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["per_core_images_per_s"] > 0
    refused = stoker_cli("bench", "pool", "--data", str(index), "--demand", "0", "--seconds", "0.05")
    assert refused.returncode == 2 and "--demand must be > 0" in refused.stderr
