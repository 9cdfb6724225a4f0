"""A manifest's shard format and root (issue 42): tar and Parquet shards named by their object path under a root,
written and read back; hostile names, formats and roots refused naming what is wrong; a fuzz of the new keys; the
registry of shard formats (``shard_format``); an index anywhere whose root names where the shards are, a path or
a URL."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.dataset.sources import DatasetError, RecordError, RemoteOptions, open_dataset
from stoker.producer.dataset.sources.manifest import MANIFEST, MAX_OBJECT_PATH, parse_manifest
from stoker.producer.dataset.sources.shard_cache import fetch_log
from stoker.producer.dataset.sources.shard_format import shard_format

SHA = "ab" * 32


def _body(shard_format: str | None = "tar", names: tuple[str, ...] = ("000000.tar", "000001.tar"),
          root: object = None, records: tuple[int, ...] = (3, 5)) -> dict:
    body = {"format": "stoker-shards", "version": 1, "count": sum(records), "fields": {"image": "image"},
            "shards": [{"name": n, "records": r, "bytes": 10 * r, "sha256": SHA} for n, r in zip(names, records)]}
    if shard_format is not None:
        body["shard_format"] = shard_format
    if root is not None:
        body["root"] = root
    return body


@pytest.mark.parametrize("shard_format, names, root", [
    ("tar", ("000000.tar", "a/b/000001.tar"), "s3://bucket/laion/"),
    ("parquet", ("train/part-0000.parquet", "train/part 0001.parquet"), "/data/hf"),
    ("lmdb", ("shard-00000", "shard-00001"), None),
])
def test_a_manifest_of_any_shard_format_reads_back_what_it_wrote(shard_format, names, root):
    parsed = parse_manifest(json.dumps(_body(shard_format, names, root)).encode(), "index.json")
    assert (parsed.shard_format, parsed.root, [s.name for s in parsed.shards]) == (shard_format, root, list(names))
    again = parse_manifest(parsed.to_json().encode(), "again.json")
    assert again == parsed
    assert ("shard_format" in json.loads(parsed.to_json())) == (shard_format != "lmdb")  # LMDB's as before


def test_a_manifest_without_the_new_keys_is_lmdb_beside_it():
    parsed = parse_manifest(json.dumps(_body(None, ("shard-00000", "shard-00001"))).encode(), "m.json")
    assert (parsed.shard_format, parsed.root) == ("lmdb", None)
    assert parsed.mean_shard_records == 4  # 8 records in 2 shards of 3 and 5


@pytest.mark.parametrize("change, message", [
    (dict(shard_format="zip"), "'shard_format' 'zip' is none of lmdb, tar, parquet"),
    (dict(shard_format=["tar"]), "'shard_format'"),
    (dict(root="relative/path"), "'root' must be an fsspec URL"),
    (dict(root=""), "'root' must be"),
    (dict(root=7), "'root' must be"),
    (dict(root="/data/\n"), "'root' must be"),
    (dict(names=("../000000.tar", "x.tar")), "shard 0 must be .*no '..'"),
    (dict(names=("a/../../x.tar", "x.tar")), "shard 0 must be"),
    (dict(names=("/etc/passwd", "x.tar")), "shard 0 must be"),
    (dict(names=("a//b.tar", "x.tar")), "shard 0 must be"),
    (dict(names=("a/./b.tar", "x.tar")), "shard 0 must be"),
    (dict(names=("a\\b.tar", "x.tar")), "shard 0 must be"),
    (dict(names=("x.tar", "é.tar")), "shard 1 must be"),
    (dict(names=("x.tar\n", "y.tar")), "shard 0 must be"),
    (dict(names=("x" * (MAX_OBJECT_PATH + 1), "y.tar")), "shard 0 must be"),
    (dict(names=("x.tar", "x.tar")), "two shards have one name"),
    (dict(shard_format="lmdb"), "shard 0 must be {name: shard-NNNNN"),  # an LMDB shard is never a path
])
def test_a_hostile_shard_format_root_or_object_path_is_refused_naming_it(change, message):
    with pytest.raises(DatasetError, match=message):
        parse_manifest(json.dumps(_body(**change)).encode(), "index.json")


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(shard_format=st.sampled_from(["tar", "parquet", "lmdb"]) | _JSON, root=_JSON | st.text(max_size=20),
       names=st.lists(st.text(max_size=12) | _JSON, min_size=1, max_size=3))
def test_any_shard_format_root_or_names_parse_or_are_a_dataset_error(shard_format, root, names):
    body = _body("tar", root=None, names=tuple(f"{i}.tar" for i in range(len(names))), records=(1,) * len(names))
    body["shard_format"], body["root"] = shard_format, root
    for shard, name in zip(body["shards"], names):
        shard["name"] = name
    try:
        parsed = parse_manifest(json.dumps(body).encode(), "fuzz.json")
    except DatasetError:
        return
    assert parsed.shard_format in ("lmdb", "tar", "parquet")
    assert parsed.root is None or "://" in parsed.root or parsed.root.startswith("/")
    for shard in parsed.shards:  # whatever was accepted stays under the root
        assert not shard.name.startswith("/") and ".." not in shard.name.split("/") and "\\" not in shard.name


def test_the_registry_gives_each_format_by_name_and_refuses_others_naming_what_it_reads():
    lmdb = shard_format("lmdb")
    assert (lmdb.name, lmdb.local_name, lmdb.object_name("shard-00003")) == ("lmdb", "data.mdb", "shard-00003/data.mdb")
    with pytest.raises(DatasetError, match="no shard format 'zip': this Stoker reads lmdb, tar, parquet"):
        shard_format("zip")


def test_a_format_whose_package_is_missing_names_the_extra_that_brings_it():
    if importlib.util.find_spec("stoker.producer.dataset.sources.parquet_shard") is None:
        pytest.skip("no Parquet shard format in this tree yet")
    blocked = ("import sys; sys.modules['pyarrow'] = None\n"  # as on a host without the extra
               "from stoker.producer.dataset.sources.shard_format import shard_format\n"
               "try:\n    shard_format('parquet')\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("DatasetError reading parquet shards needs the package 'pyarrow'") and \
        "pip install 'stoker[parquet]'" in out, out


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded LMDB of 40 small records in several shards (no images: fast)."""
    out = tmp_path_factory.mktemp("small") / "ds"
    report = write_lmdb(out, ({"label": i % 3, "blob": bytes([i]) * 900} for i in range(40)), progress=False,
                        check_images=False, shard_bytes=8_000)
    assert not report.skipped
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) >= 3
    return out


def _index(folder: Path, at: Path, root: str) -> Path:
    """The folder's manifest written at ``at`` with a ``root`` saying where the shards are: an index anywhere."""
    body = json.loads((folder / MANIFEST).read_text())
    at.write_text(json.dumps(dict(body, root=root)))
    return at


@pytest.mark.parametrize("where", ["local index, local root", "local index, URL root", "URL index, URL root"])
def test_an_index_anywhere_reads_the_shards_its_root_names_locally_or_through_the_cache(small_shards, tmp_path,
                                                                                          where):
    index_local, root_local = where.startswith("local"), where.endswith("local root")
    index = _index(small_shards, tmp_path / "elsewhere.json", str(small_shards) if root_local else
                   f"file://{small_shards}")
    location = str(index) if index_local else f"file://{index}"
    remote = RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_bytes=10**7)
    with open_dataset(small_shards) as beside:  # one LMDB is opened once in a process: read, then closed
        expected = [beside.read(i) for i in range(len(beside))]
    with open_dataset(location, remote) as dataset:
        assert dataset.layout is not None and len(dataset) == len(expected) == 40
        assert [dataset.read(i) for i in range(40)] == expected
        assert (dataset.holdings()[0] is None) == root_local  # a URL root reads through the bounded cache
        assert dataset.manifest_bytes == index.read_bytes()
    assert bool(fetch_log(tmp_path / "cache")) != root_local


def test_an_index_from_storage_naming_a_local_root_or_another_scheme_is_refused(small_shards, tmp_path):
    """An index read from object storage is not trusted to point this host at its own files (read in place, no
    checksum) or at another service reached with this producer's credentials."""
    remote = RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_bytes=10**7)
    for root in (str(small_shards), f"s3://bucket/{small_shards.name}"):
        index = _index(small_shards, tmp_path / "elsewhere.json", root)
        with pytest.raises(DatasetError, match="an index read from file:// must keep its shards under file://"):
            open_dataset(f"file://{index}", remote)


def test_a_missing_index_or_a_missing_shard_under_its_root_is_named(small_shards, tmp_path):
    with pytest.raises(DatasetError, match="no manifest at .*nothing.json"):
        open_dataset(tmp_path / "nothing.json")
    index = _index(small_shards, tmp_path / "index.json", str(tmp_path / "moved"))
    with open_dataset(index) as dataset:
        with pytest.raises(RecordError, match="shard shard-00000 is missing: no .*moved/shard-00000/data.mdb"):
            dataset.read(0)
