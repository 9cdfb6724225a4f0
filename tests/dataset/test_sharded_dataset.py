"""Sharded datasets on local disk (issue 33): the builder writes shards and a manifest with the same checks as one
LMDB, the reader gives every record at its global index, hostile manifests are refused naming what is wrong, and
a producer serves a sharded folder with exact epochs. Object storage: tests/dataset/test_object_storage.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from stoker.consumer import BatchStream
from stoker.producer.dataset.sources import DatasetError, LmdbDataset, RecordError, ShardedDataset, open_dataset
from stoker.producer.dataset.sources.shard_cache import fetch_log
from stoker.producer.dataset.sources.manifest import MANIFEST, parse_manifest
from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.process import ProducerProcess

pytestmark = pytest.mark.timeout(300)
RECORDS = 60


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("single") / "ds"
    build_synthetic(path, RECORDS, seed=4, num_classes=3, progress=False)
    return path


@pytest.fixture(scope="module")
def sharded(single: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same records, in shards of about 600 KB (synthetic JPEGs are ~100 KB: several shards)."""
    out = tmp_path_factory.mktemp("sharded") / "ds"
    with LmdbDataset(single) as ds:
        report = write_lmdb(out, (ds.read(i) for i in range(len(ds))), classes=ds.meta.classes, progress=False,
                            shard_bytes=600_000)
    assert not report.skipped
    return out


def test_the_shards_hold_every_record_at_its_global_index_with_the_manifest_checksums(single, sharded):
    manifest = json.loads((sharded / MANIFEST).read_text())
    assert manifest["count"] == RECORDS and len(manifest["shards"]) >= 3
    assert sum(s["records"] for s in manifest["shards"]) == RECORDS
    with LmdbDataset(single) as one, open_dataset(sharded) as many:
        assert isinstance(many, ShardedDataset) and len(many) == RECORDS
        assert many.meta.classes == one.meta.classes and many.meta.class_counts == one.meta.class_counts
        for i in range(RECORDS):
            assert many.read(i) == one.read(i)
        # Backwards and shuffled too: a read remembers the shard it was in, and must leave it at its edges.
        for i in [*range(RECORDS - 1, -1, -1), *np.random.default_rng(3).permutation(RECORDS).tolist()]:
            assert many.read(i) == one.read(i), i
        for outside in (-1, RECORDS):
            with pytest.raises(IndexError):
                many.read(outside)
        assert (many.layout, many.holdings(), one.layout, one.holdings()) == (many.manifest, (None, []), None,
                                                                               (None, []))  # the RecordSource's
    shard = sharded / manifest["shards"][1]["name"]
    with LmdbDataset(shard) as alone, LmdbDataset(single) as one:  # each shard is a Stoker LMDB of its own
        assert len(alone) == manifest["shards"][1]["records"] and alone.meta.classes == one.meta.classes
        first = manifest["shards"][0]["records"]
        assert alone.read(0) == one.read(first)  # its key 0 is the dataset's record `first`


def test_stoker_lmdb_build_shards_a_folder_and_info_describes_it(single, tmp_path):
    images = tmp_path / "images"
    with LmdbDataset(single) as ds:
        for i in range(len(ds)):
            record = ds.read(i)
            (images / f"c{record['label']}").mkdir(parents=True, exist_ok=True)
            (images / f"c{record['label']}" / f"{i:03d}.jpg").write_bytes(record["image"])
    (images / "c0" / "notes.txt").write_text("not an image")
    stoker = [sys.executable, "-m", "stoker.cli.main"]
    built = subprocess.run([*stoker, "lmdb", "build", str(images), str(tmp_path / "out"), "--shard-size", "1MB",
                            "--quiet"], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert "skipped" in built.stdout and "notes.txt" in built.stdout  # named, as for one LMDB
    info = subprocess.run([*stoker, "lmdb", "info", str(tmp_path / "out"), "--samples", "1"], capture_output=True,
                          text=True, timeout=60)
    assert info.returncode == 0 and "format:   stoker-shards version 1:" in info.stdout, info.stderr
    assert f"records:  {RECORDS}" in info.stdout
    bad = subprocess.run([*stoker, "lmdb", "build", str(images), str(tmp_path / "x"), "--shard-size", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a size" in bad.stderr


def _manifest(sharded: Path) -> dict:
    return json.loads((sharded / MANIFEST).read_text())


def _shards_of(manifest: dict, records: list[int]) -> list[dict]:
    """Shards like the manifest's first, holding ``records`` each (their files are never read here)."""
    return [dict(manifest["shards"][0], name=f"shard-{i:05d}", records=n) for i, n in enumerate(records)]


def test_a_manifest_names_up_to_2_to_the_40_records_in_shards_of_one_lmdb_each(sharded):
    manifest = _manifest(sharded)
    full, rest = divmod(2**40, 10**8 - 1)  # shards as large as one LMDB holds, and the remainder
    manifest.update(shards=_shards_of(manifest, [10**8 - 1] * full + [rest]), count=2**40, class_counts=None)
    parsed = parse_manifest(json.dumps(manifest).encode(), "m.json")
    assert parsed.meta.count == 2**40 and parsed.shard_of(2**40 - 1) == full


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(format="other"), "'format' is not 'stoker-shards'"),
    (lambda m: m.update(version=9), "version 9"),
    (lambda m: m.update(count=m["count"] + 1), "not the shards' records added up"),
    (lambda m: m["shards"][0].update(name="../../etc"), "shard 0 must be"),
    (lambda m: m["shards"][0].update(sha256="zz"), "shard 0 must be"),
    (lambda m: m["shards"][1].update(name=m["shards"][0]["name"]), "two shards have one name"),
    (lambda m: m.update(shards=[]), "must list 1-"),
    (lambda m: m.update(class_counts=[1, 2, 3]), "'class_counts' must give"),
    (lambda m: m.update(fields={}), "'fields' must map"),
    (lambda m: m["shards"][0].update(name="shard-00000\n"), "shard 0 must be"),
    (lambda m: m["shards"][0].update(name="shard-٠٠٠٠٠"), "shard 0 must be"),  # not ASCII digits
    (lambda m: m.update(fields={"image": {"kind": "array", "dtype": "uint8", "ndim": [1]}}), "'fields'"),
    (lambda m: m["shards"][0].update(records=10**8), "records below 10"),  # one LMDB's 8-digit keys
    (lambda m: m.update(shards=_shards_of(m, [10**8 - 1] * 10_996), count=10_996 * (10**8 - 1)), "1 to 2"),
])
def test_a_manifest_that_does_not_describe_a_dataset_is_refused_naming_why(sharded, change, message):
    manifest = _manifest(sharded)
    change(manifest)
    with pytest.raises(DatasetError, match=message.replace("[", r"\[")):
        parse_manifest(json.dumps(manifest).encode(), "m.json")
    with pytest.raises(DatasetError, match="invalid JSON"):
        parse_manifest(b"{not json", "m.json")


def test_a_missing_or_foreign_shard_costs_its_records_named_never_the_reader(sharded, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    shards = _manifest(copy)["shards"]
    shutil.rmtree(copy / shards[1]["name"])
    with open_dataset(copy) as ds:
        first = shards[0]["records"]
        with pytest.raises(RecordError, match=f"shard {shards[1]['name']}: shard {shards[1]['name']} is missing"):
            ds.read(first)
        with pytest.raises(RecordError) as second:  # each record is named as itself, not as its shard's first
            ds.read(first + 1)
        assert second.value.key == b"%08d" % (first + 1) and str(second.value).count("record ") == 1
        assert ds.read(0) is not None and ds.read(RECORDS - 1) is not None


def test_a_producer_serves_a_sharded_folder_with_exact_epochs(sharded):
    flags = ["--workers", "2", "--batch-size", "8", "--image-size", "32", "--exact", "--epochs", "2", "--seed", "3"]
    seen: Counter = Counter()
    with ProducerProcess(sharded, extra_args=flags) as producer:
        with BatchStream([producer.endpoint], exact=True, recv_timeout=60) as stream:
            for batch in stream:
                seen.update(zip(batch["epoch"].tolist(), batch["index"].tolist()))
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(RECORDS)] and set(seen.values()) == {1}


def test_a_bounded_cache_fetches_checks_evicts_and_fetches_again_through_any_fsspec_url(sharded, tmp_path,
                                                                                      monkeypatch):
    """The object-storage path on a file:// URL (fsspec's local filesystem, real files and LMDBs): a cache that
    holds one shard fetches each shard when it is needed, evicts the least recently used, lets a reader of an
    evicted shard go (checked every time here) and fetches it again; every fetch is counted."""
    from stoker.producer.dataset.sources import sharded as sharded_module
    from stoker.producer.dataset.sources.object_storage import open_remote

    monkeypatch.setattr(sharded_module, "CHECK_EVICTED_S", 0.0)
    manifest = _manifest(sharded)["shards"]
    biggest = max(s["bytes"] for s in manifest)
    cache = tmp_path / "cache"
    with open_remote(f"file://{sharded}", cache_dir=cache, cache_bytes=biggest + 1) as ds, \
            LmdbDataset(sharded / manifest[0]["name"]) as first_shard:
        first, second = 0, manifest[0]["records"]  # a record of shard 0 and one of shard 1
        assert ds.read(first) == first_shard.read(0)
        ds.read(second)  # shard 1 fetched, shard 0 evicted to make room
        ds.read(first)  # shard 0 was let go of and is fetched again
        fetches = [f["shard"] for f in fetch_log(cache)]
        assert fetches == [manifest[0]["name"], manifest[1]["name"], manifest[0]["name"]]
        assert sum(f.stat().st_size for f in (cache / "shards").rglob("data.mdb")) <= biggest + 1
    with pytest.raises(DatasetError, match="raise --cache-size"):
        open_remote(f"file://{sharded}", cache_dir=cache, cache_bytes=biggest - 1)
    with pytest.raises(DatasetError, match="no sharded dataset at"):
        open_remote(f"file://{tmp_path}/nothing", cache_dir=cache, retry_seconds=1)


@pytest.mark.parametrize("moment", ["while_opening", "after_opening"])
def test_a_shard_evicted_by_another_worker_as_it_is_opened_is_fetched_again_never_skipped(sharded, tmp_path,
                                                                                           monkeypatch, moment):
    """Workers share one cache: another worker's eviction (the cache's own ``shutil.rmtree`` of the shard's folder)
    can land between a reader's fetch and its open, or inside the open (after LMDB opened the file, before its
    size was checked). Either way the reader lets the shard go and fetches it again: the record is read, never
    skipped (a CI run once lost a record so, FileNotFoundError on data.mdb)."""
    import shutil

    from stoker.producer.dataset.sources import lmdb_dataset as lmdb_module
    from stoker.producer.dataset.sources.object_storage import open_remote

    manifest = _manifest(sharded)["shards"]
    with LmdbDataset(sharded / manifest[0]["name"]) as first_shard:
        expected = first_shard.read(0)
    evictions = []

    def evict_once(path: Path) -> None:
        if not evictions:
            evictions.append(path)
            shutil.rmtree(path)  # what ShardCache._make_room does in another worker

    if moment == "while_opening":
        read_meta = lmdb_module._read_meta
        monkeypatch.setattr(lmdb_module, "_read_meta", lambda path, env: (evict_once(path), read_meta(path, env))[1])
    else:
        opened = lmdb_module.LmdbShardFormat.open

        def open_then_evict(self: object, path: Path, info: object, meta: object) -> LmdbDataset:
            dataset = opened(self, path, info, meta)  # type: ignore[arg-type]
            evict_once(path.parent)
            return dataset
        monkeypatch.setattr(lmdb_module.LmdbShardFormat, "open", open_then_evict)
    cache = tmp_path / "cache"
    with open_remote(f"file://{sharded}", cache_dir=cache, cache_bytes=10**9) as ds:
        assert ds.read(0) == expected
    assert len(evictions) == 1
    assert [f["shard"] for f in fetch_log(cache)] == [manifest[0]["name"]] * 2  # fetched again, once


def _tar(path: Path, members: list[tuple[str, bytes]], symlink: str = "") -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink:
            link = tarfile.TarInfo(symlink)
            link.type = tarfile.SYMTYPE
            link.linkname = "/etc/passwd"
            tar.addfile(link)


def webdataset_tars(single: Path, folder: Path) -> list[tuple[int, int]]:
    """Two WebDataset tars of the single LMDB's first 20 records, with bad samples mixed in; the (record, label)
    of each good sample, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    good = []
    with LmdbDataset(single) as ds:
        for part in range(2):
            members = []
            for i in range(part * 10, part * 10 + 10):
                record = ds.read(i)
                members += [(f"train/{i:05d}.jpg", record["image"]), (f"train/{i:05d}.cls", b"%d" % record["label"])]
                good.append((i, record["label"]))
            members += [(f"bad/{part}-huge.jpg", ds.read(2)["image"]), (f"bad/{part}-huge.cls", b"99999999999"),
                        (f"bad/{part}-nolabel.jpg", ds.read(0)["image"]),
                        (f"bad/{part}-text.png", ds.read(1)["image"]), (f"bad/{part}-text.cls", b"cat"),
                        (f"bad/{part}-notimage.jpg", b"not an image"), (f"bad/{part}-notimage.cls", b"1")]
            _tar(folder / f"shard-{part:04d}.tar", members, symlink=f"bad/{part}-link.jpg")
    return good


def test_stoker_lmdb_build_from_webdataset_tars_names_every_sample_it_leaves_out(single, tmp_path):
    good = webdataset_tars(single, tmp_path / "wds")
    truncated = (tmp_path / "wds" / "shard-0001.tar").read_bytes()
    (tmp_path / "wds" / "shard-0002.tar").write_bytes(truncated[: len(truncated) // 3])  # cut mid-member
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "lmdb", "build", str(tmp_path / "wds"),
                          str(tmp_path / "out"), "--from", "webdataset", "--shard-size", "500KB", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with open_dataset(tmp_path / "out") as ds, LmdbDataset(single) as source:
        stored = [(ds.read(i)["image"], ds.read(i)["label"]) for i in range(len(ds))]
        first_tars = [(source.read(i)["image"], label) for i, label in good]
        assert stored[: len(first_tars)] == first_tars  # the good samples of the two whole tars, in order
        assert isinstance(ds, ShardedDataset)
    for reason in ("bad/0-huge: label 99999999999 is outside 0-1000000", "bad/0-nolabel: no label member", "bad/0-text: label b'cat' is not an integer",
                   "bad/1-link.jpg: not a regular file", "bad/0-notimage:", "shard-0002.tar: the tar is unreadable"):
        assert reason in out.stdout, (reason, out.stdout)
    assert "skipped" in out.stdout and "samples" in out.stdout
