"""Shards of unequal record counts (WebDataset tars, Parquet files): an epoch goes by blocks of the mean shard size
over global indices (``sharding.layout_block``), and what the producer says and fetches is about those blocks
(``producer/serve/block_layout.py``): a pool producer's cache is said as the blocks its shards hold whole, since its
trainer hands splits by block; a worker fetches ahead every shard of the next block (up to eight); a layout so uneven
that a bounded cache fetches shards more than once an epoch is warned of at start.

Real tars indexed by ``index_webdataset`` and read through a real ``ShardCache`` (a ``file://`` root) where the
dataset is read; plain manifests where the layout alone decides.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from stoker.protocol.exact_messages import MAX_HELD
from stoker.protocol.input_state import StreamKey
from stoker.producer.dataset.build.webdataset_index import index_webdataset
from stoker.producer.dataset.sources import RemoteOptions, open_dataset
from stoker.producer.dataset.sources.lmdb_format import DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import MANIFEST, Manifest, ShardInfo
from stoker.producer.dataset.sources.shard_cache import PREFETCH_AHEAD_SHARDS, PREFETCH_THREAD, fetch_log
from stoker.producer.serve.block_layout import BlockHoldings, BlockSpans, block_shards, fetch_block_ahead
from stoker.producer.serve.policies.pool import PoolPolicy
from stoker.producer.serve.sharding import ShardSpec, layout_block

# 60 samples in 6 tars: blocks of 10 (the mean). Block 1 (10-19) touches tars 1, 2 and 3; tar 3 (15-44) lies in
# blocks 1 to 4, wholly in none of them but 2 and 3.
TAR_SAMPLES = (10, 2, 3, 30, 5, 10)


def _manifest(counts: list[int], shard_bytes: int = 100) -> Manifest:
    shards, first = [], 0
    for i, n in enumerate(counts):
        shards.append(ShardInfo(f"shard-{i:05d}", first, n, shard_bytes, "0" * 64))
        first += n
    return Manifest(DatasetMeta(count=first, fields={"label": FieldKind.parse("int")}), tuple(shards))


@pytest.fixture(scope="module")
def uneven_tars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tars of TAR_SAMPLES captions each (no images: fast) and their index, written as ``manifest.json`` beside them
    with a ``file://`` root, so ``open_dataset`` reads them through the bounded cache."""
    folder = tmp_path_factory.mktemp("uneven")
    first = 0
    for number, count in enumerate(TAR_SAMPLES):
        with tarfile.open(folder / f"{number:06d}.tar", "w") as tar:
            for i in range(first, first + count):
                data = f"caption {i}".encode()
                info = tarfile.TarInfo(f"{i:09d}.txt")
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
        first += count
    manifest = index_webdataset([str(folder / "*.tar")], progress=False)
    assert [s.records for s in manifest.shards] == list(TAR_SAMPLES)
    (folder / MANIFEST).write_text(Manifest(manifest.meta, manifest.shards, "tar", f"file://{folder}").to_json())
    return folder


def _blocks_held_naively(manifest: Manifest, size: int, held: list[int]) -> list[int]:
    """The reference: each block whose non-empty shards are all held, ordered by its least recently used shard."""
    rank = {shard: place for place, shard in reversed(list(enumerate(held)))}
    found = []
    for block in range(-(-manifest.meta.count // size)):
        start, end = block * size, min((block + 1) * size, manifest.meta.count)
        touched = [n for n, s in enumerate(manifest.shards) if s.records and s.first < end and s.first + s.records > start]
        if all(n in rank for n in touched):
            found.append((min(rank[n] for n in touched), block))
    return [block for _, block in sorted(found)][-MAX_HELD:]


def test_a_cache_of_unequal_tars_is_said_as_the_blocks_its_tars_hold_whole_least_recently_used_first(uneven_tars,
                                                                                                      tmp_path):
    cache = tmp_path / "cache"
    remote = RemoteOptions(cache_dir=str(cache), cache_bytes=10**7)
    with open_dataset(f"file://{uneven_tars}", remote) as dataset:
        block = layout_block(ShardSpec(auto=True), 1, dataset.layout)
        assert block == 10
        for index in (0, 15, 45, 50):  # tars 0, 3, 4 and 5 fetched into the cache; 1 and 2 are not
            dataset.read(index)
        shards = dataset.layout.shards
        for when, shard in enumerate((3, 0, 5, 4)):  # their use, oldest first, set where the cache reads it
            os.utime(cache / "shards" / shards[shard].sha256, (1_700_000_000 + when,) * 2)
        capacity, held = dataset.holdings()
        assert held == [3, 0, 5, 4]  # the cache's own numbers: manifest shards
        blocks = BlockHoldings(dataset, block).holdings()
    # Blocks 2 and 3 lie in tar 3, block 4 in tars 3 and 4: tar 3's use (the oldest) orders them; block 1 needs tars
    # 1 and 2. As shard numbers the trainer would have read blocks 3, 0, 5, 4 and missed block 2.
    assert blocks[1] == [2, 3, 4, 0, 5] == _blocks_held_naively(dataset.layout, block, held)
    needed = [[0], [1, 2, 3], [3], [3], [3, 4], [5]]  # the shards each block touches: held only with all of them
    mean_touched = sum(shards[n].bytes for touched in needed for n in touched) / 6
    mean_shard = sum(s.bytes for s in shards) / 6
    assert blocks[0] == max(1, int(capacity * mean_shard // mean_touched)) < capacity  # tar 3 costs its blocks
    # The status a pool producer sends names the blocks.
    key = StreamKey(0, 1, 60, 1, splits=True, block=block)
    with open_dataset(f"file://{uneven_tars}", remote) as dataset:
        assert PoolPolicy(key, "p", 1, cache=BlockHoldings(dataset, block)).status().held == [2, 3, 4, 0, 5]


def test_equal_shards_or_every_shard_on_disk_are_said_as_the_cache_says_them(uneven_tars, small_equal_shards):
    index = uneven_tars / "in-place.json"  # the same index with a local root: every shard on disk, no cache
    index.write_text((uneven_tars / MANIFEST).read_text().replace(f'"file://{uneven_tars}"', f'"{uneven_tars}"'))
    with open_dataset(index) as local:
        assert local.holdings() == (None, []) and BlockHoldings(local, 10).holdings() == (None, [])
    remote = RemoteOptions(cache_dir=str(small_equal_shards.parent / "cache"), cache_bytes=10**7)
    with open_dataset(f"file://{small_equal_shards}", remote) as dataset:
        assert dataset.layout.records_per_shard
        for index in range(0, len(dataset), dataset.layout.records_per_shard):
            dataset.read(index)
        assert BlockHoldings(dataset, dataset.layout.records_per_shard).holdings() == dataset.holdings()
        assert BlockHoldings(dataset, 0).holdings() == dataset.holdings()  # no layout: as before


@pytest.fixture(scope="module")
def small_equal_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four tars of 5 captions each: shards of one record count."""
    folder = tmp_path_factory.mktemp("equal") / "tars"
    folder.mkdir()
    for number in range(4):
        with tarfile.open(folder / f"{number:06d}.tar", "w") as tar:
            for i in range(number * 5, number * 5 + 5):
                info = tarfile.TarInfo(f"{i:09d}.txt")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
    manifest = index_webdataset([str(folder / "*.tar")], progress=False)
    (folder / MANIFEST).write_text(Manifest(manifest.meta, manifest.shards, "tar", f"file://{folder}").to_json())
    return folder


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=12).filter(lambda c: sum(c) > 0), st.data())
def test_the_blocks_held_are_exactly_those_wholly_in_held_shards_for_any_layout(counts, data):
    manifest = _manifest(counts)
    size = manifest.mean_shard_records
    held = data.draw(st.lists(st.integers(0, len(counts) + 2), unique=True, max_size=len(counts) + 3))
    assert BlockSpans(manifest, size).held_blocks(held) == _blocks_held_naively(manifest, size, held)


def test_at_most_max_held_blocks_are_said_the_most_recently_used():
    manifest = _manifest([1] * 300 + [600])  # blocks of 3 records: 100 of tiny shards, then 200 of the last
    held = list(range(301))
    blocks = BlockSpans(manifest, manifest.mean_shard_records).held_blocks(held)
    assert len(blocks) == MAX_HELD and blocks == _blocks_held_naively(manifest, manifest.mean_shard_records, held)


# ---- a block touches every shard its records lie in: fetched ahead, and a very uneven layout warned of -------------

def _touched_naively(manifest: Manifest, size: int, block: int) -> list[int]:
    start, end = block * size, min((block + 1) * size, manifest.meta.count)
    return [n for n, s in enumerate(manifest.shards) if s.records and s.first < end and s.first + s.records > start]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=2, max_size=30).filter(lambda c: sum(c) > 0), st.integers(0, 12))
def test_a_block_names_every_shard_its_records_lie_in_up_to_the_limit(counts, limit):
    manifest = _manifest(counts)
    size = manifest.mean_shard_records
    for block in range(-(-manifest.meta.count // size) + 1):  # one past the last: none
        assert block_shards(manifest, size, block, limit) == _touched_naively(manifest, size, block)[:limit]


@pytest.fixture(scope="module")
def tiny_then_huge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten tars of one caption, then one of 200: blocks of 20, the first touching all eleven tars."""
    folder = tmp_path_factory.mktemp("tiny-then-huge")
    first = 0
    for number, count in enumerate([1] * 10 + [200]):
        with tarfile.open(folder / f"{number:06d}.tar", "w") as tar:
            for i in range(first, first + count):
                info = tarfile.TarInfo(f"{i:09d}.txt")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        first += count
    manifest = index_webdataset([str(folder / "*.tar")], progress=False)
    (folder / MANIFEST).write_text(Manifest(manifest.meta, manifest.shards, "tar", f"file://{folder}").to_json())
    return folder


def test_a_worker_fetches_ahead_every_shard_of_the_next_block_up_to_eight(tiny_then_huge, tmp_path):
    """Block 0 touches eleven tars: the first eight are fetched ahead, on the cache's prefetch thread (the old fetch
    ahead took the first two of a block, and the cache kept two waiting)."""
    cache = tmp_path / "cache"
    with open_dataset(f"file://{tiny_then_huge}", RemoteOptions(cache_dir=str(cache), cache_bytes=10**8)) as dataset:
        size = layout_block(ShardSpec(auto=True), 1, dataset.layout)
        assert size == 20 and len(_touched_naively(dataset.layout, size, 0)) == 11
        asked = fetch_block_ahead(dataset, size, 0)
        assert asked == list(range(PREFETCH_AHEAD_SHARDS)) == list(range(8))
        names = {dataset.layout.shards[n].name for n in asked}
        deadline = time.monotonic() + 60  # a condition awaited, not a time: it holds as soon as the fetches are done
        while len(fetch_log(cache)) < len(asked) and time.monotonic() < deadline:
            time.sleep(0.02)
        fetched = fetch_log(cache)
        assert {f["shard"] for f in fetched} == names and all(f["ahead"] for f in fetched), fetched
        assert fetch_block_ahead(dataset, 0, 0) == []  # no layout: nothing asked
    # Closing the dataset ends its cache's prefetch thread: a process that opens and closes datasets (a test run, a
    # notebook) does not keep one per dataset (a CI run once found this one alive in a later test's thread check).
    assert not [t for t in threading.enumerate() if t.name == PREFETCH_THREAD]


def test_a_very_uneven_layout_is_warned_of_once_naming_the_refetches_and_the_fix(caplog):
    caplog.set_level(logging.INFO, logger="stoker.producer")
    auto = ShardSpec(auto=True)

    def warnings_for(counts):
        caplog.clear()
        layout_block(auto, 1, _manifest(counts))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings_for([50, 40, 50]) == [] and warnings_for([50, 50, 20]) == []  # near-equal, or equal
    assert warnings_for([30, 60, 45, 20, 35]) == []  # the largest 1.6x the mean, blocks of two or three shards
    huge = warnings_for([10] * 9 + [100])  # a shard of 100 among blocks of 19: read in six blocks
    tiny = warnings_for([20, 20, 1, 1, 1, 1, 1, 1, 20, 20])  # blocks of 9: one touches 6 shards
    for said, what in ((huge, "the largest holds 100 records (5.3x the mean)"), (tiny, "touches up to 6 shards")):
        assert len(said) == 1 and what in said[0], said
        assert all(text in said[0] for text in ("more than once an epoch", "reshard", "--shuffle-window 0"))
