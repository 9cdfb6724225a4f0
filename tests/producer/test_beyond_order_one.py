"""A dataset beyond epoch order 1 (issue 41): a sharded dataset may hold more than 10**8 records, and a producer
started on one in epoch order 1 refuses at start, naming the limit and the way out, instead of building an epoch
order (or consumed bitmaps) of one entry per record. Plain producers and fixed shards order their epochs the same
way, so they refuse too. An elastic pool serves such a dataset in epoch order 2 (lazy) unless told otherwise; a fixed
shard in order 2 when asked, if its own records fit its per-record bookkeeping.

The dataset is a real sharded folder whose manifest claims shards of 40 million records: the producer must refuse
from the manifest alone, before it reads a shard (which hold far fewer) or binds its socket.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_worker_producer, stoker_cli, unused_port, wait_for_producer_log

from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.dataset.sources import LmdbDataset
from stoker.producer.dataset.sources.manifest import MANIFEST

pytestmark = pytest.mark.timeout(300)
CLAIMED = 40_000_000  # records each shard's manifest entry claims: three or more shards add up past 10**8


@pytest.fixture(scope="module")
def huge(synth_lmdb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("huge") / "ds"
    with LmdbDataset(synth_lmdb) as ds:
        write_lmdb(out, (ds.read(i) for i in range(len(ds))), classes=ds.meta.classes, progress=False,
                   shard_bytes=200_000)
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["shards"]) >= 3
    for shard in manifest["shards"]:
        shard["records"] = CLAIMED
    manifest.update(count=CLAIMED * len(manifest["shards"]), class_counts=None)
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("flags", [["--exact"], ["--shard", "auto", "--epoch-order", "1"],
                                   ["--shard", "1/2", "--epochs", "1"], []],
                         ids=["exact", "pool-in-order-1", "fixed-shard", "plain"])
def test_a_producer_on_more_than_10_to_the_8_records_refuses_at_start_naming_order_2(huge, flags):
    out = stoker_cli("produce", "--lmdb", str(huge), "--bind", f"tcp://127.0.0.1:{unused_port()}", "--workers", "1",
                     "--batch-size", "4", "--image-size", "32", *flags, timeout=120)
    assert out.returncode == 2, out.stderr
    assert (f"dataset {huge} holds " in out.stderr
            and "epoch order 1 keeps one entry per record and serves at most 100,000,000 (10**8) records; "
                "order 2 (lazy) is needed beyond" in out.stderr), out.stderr


def test_a_fixed_shard_in_epoch_order_2_serves_when_its_own_records_fit(huge):
    """``--shard 0/S`` is one dataset shard of 4*10^7 records: its epochs are per-record arrays over those alone, so
    it serves in order 2 (its key ends ``:o2``) however large the dataset; no epoch is built before a hello."""
    shards = len(json.loads((huge / MANIFEST).read_text())["shards"])
    with one_worker_producer(huge, "--shard", f"0/{shards}", "--exact", "--epoch-order", "2", batch=4,
                             size=32) as producer:
        log = wait_for_producer_log(producer, ("serving",), seconds=60)
    assert f"0/{shards}:{CLAIMED * shards}:" in log and ":o2" in log, log[-2000:]


def test_a_fixed_shard_in_epoch_order_2_of_more_than_10_to_the_8_records_refuses_naming_its_stream(huge):
    out = stoker_cli("produce", "--lmdb", str(huge), "--bind", f"tcp://127.0.0.1:{unused_port()}", "--workers", "1",
                     "--batch-size", "4", "--image-size", "32", "--exact", "--epoch-order", "2", timeout=120)
    assert out.returncode == 2 and "fixed shard 0/1:" in out.stderr and "holds" in out.stderr, out.stderr


def test_an_elastic_pool_on_more_than_10_to_the_8_records_serves_in_epoch_order_2(huge):
    """No order is built at start: the producer binds and serves, naming a stream key in order 2 (``:o2``)."""
    with one_worker_producer(huge, "--shard", "auto", batch=4, size=32) as producer:
        log = wait_for_producer_log(producer, ("serving",), seconds=60)
    assert f"splits:{CLAIMED * len(json.loads((huge / MANIFEST).read_text())['shards'])}:" in log
    assert ":o2" in log, log[-2000:]
