"""Fixed shards in epoch order 2 through a real run (issue 41): two exact producers ``--shard 0/2`` and ``1/2
--epoch-order 2`` on a sharded dataset, a trainer stopped mid-epoch after saving its state (ranges of each stream's
epoch positions) and resumed from it while one producer restarted knowing nothing: every record exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.consumer import BatchStream
from stoker.consumer.exact.state import parse_state
from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.dataset.sources import LmdbDataset
from stoker.producer.dataset.sources.manifest import MANIFEST
from stoker.protocol.input_state import RangeProgress, StreamKey

from conftest import assert_exactly_once, one_worker_producer, unused_port

pytestmark = pytest.mark.timeout(240)
BATCH = 4


@pytest.fixture(scope="module")
def sharded(synth_lmdb: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The synthetic dataset rewritten in shards of one record count (so fixed shards are whole shards); its size."""
    out = tmp_path_factory.mktemp("fixed_o2") / "ds"
    with LmdbDataset(synth_lmdb) as ds:
        records = len(ds)
        write_lmdb(out, (ds.read(i) for i in range(records)), classes=ds.meta.classes, progress=False,
                   shard_bytes=150_000)
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["shards"]) >= 4, "too few shards for two fixed shards of whole shards each"
    return out, records


def _producer(dataset: Path, shard: str, port: int):
    return one_worker_producer(dataset, batch=BATCH, size=16, bind=f"tcp://127.0.0.1:{port}",
                               flags=["--exact", "--seed", "3", "--shard", shard, "--epochs", "1",
                                      "--epoch-order", "2", "--shuffle-window", "2"])


def _rows(batch: dict) -> list[tuple[int, int]]:
    return list(zip(batch["epoch"].tolist(), batch["index"].tolist()))


def test_fixed_shards_in_order_2_resume_a_restored_trainer_and_a_restarted_producer_each_record_once(sharded):
    dataset, records = sharded
    ports = [unused_port()]
    while len(ports) < 2:
        ports = list({*ports, unused_port()})
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    with _producer(dataset, "1/2", ports[1]):
        with _producer(dataset, "0/2", ports[0]) as first_a:
            with BatchStream(endpoints, exact=True, batch_size=BATCH, image_shape=(16, 16, 3),
                             recv_timeout=60) as first:
                before = [row for _ in range(6) for row in _rows(next(first))]
                state = first.save_state()
            first_a.kill()  # mid-epoch: what it served and what it knew of the trainer go with it
        saved = parse_state(state).state.streams
        assert saved and all(StreamKey.parse(k).count == 2 for k in saved)
        for key, progress in saved.items():  # each stream's progress is ranges of its own epoch positions
            stream = StreamKey.parse(key)
            assert key.endswith(":o2") and stream.block > 1 and stream.window == 2
            assert isinstance(progress, RangeProgress)
            assert progress.size == stream.size < records
        with _producer(dataset, "0/2", ports[0]), BatchStream(endpoints, exact=True, batch_size=BATCH,
                                                              image_shape=(16, 16, 3), recv_timeout=60,
                                                              resume_state=state) as second:
            rest = [row for batch in second for row in _rows(batch)]
    assert len(before) == 6 * BATCH and rest
    assert_exactly_once(before + rest, set(range(records)))
