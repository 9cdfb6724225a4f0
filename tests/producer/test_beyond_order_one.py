"""A dataset beyond epoch order 1 (issue 41): a sharded dataset may hold more than 10**8 records, and a producer
started on one refuses at start, naming the limit and the way out, instead of building an epoch order (or
consumed bitmaps) of one entry per record. Plain producers order their epochs the same way, so they refuse too.

The dataset is a real sharded folder whose manifest claims shards of 40 million records: the producer must refuse
from the manifest alone, before it reads a shard (which hold far fewer) or binds its socket.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import stoker_cli, unused_port

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


@pytest.mark.parametrize("flags", [["--exact"], ["--shard", "auto"], ["--shard", "1/2", "--epochs", "1"], []],
                         ids=["exact", "pool", "fixed-shard", "plain"])
def test_a_producer_on_more_than_10_to_the_8_records_refuses_at_start_naming_order_2(huge, flags):
    out = stoker_cli("produce", "--lmdb", str(huge), "--bind", f"tcp://127.0.0.1:{unused_port()}", "--workers", "1",
                     "--batch-size", "4", "--image-size", "32", *flags, timeout=120)
    assert out.returncode == 2, out.stderr
    assert (f"dataset {huge} holds " in out.stderr
            and "epoch order 1 keeps one entry per record and serves at most 100,000,000 (10**8) records; "
                "order 2 (lazy) is needed beyond" in out.stderr), out.stderr
