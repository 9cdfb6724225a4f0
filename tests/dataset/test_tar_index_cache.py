"""A tar's sample index kept for the next process (``webdataset/index_file.py``): read back instead of walking the
tar again (in place: under the cache folder; from object storage: beside the cached copy, evicted with it), and
parsed, never trusted: a damaged, hostile or stale index file is ignored, rebuilt and overwritten."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_jpeg
from stoker.producer.dataset.build.webdataset_index import index_webdataset
from stoker.producer.dataset.sources import RemoteOptions, open_dataset, tar_shard
from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind, RecordError
from stoker.producer.dataset.sources.shard_cache import fetch_log
from stoker.producer.dataset.sources.tar_shard import TarShard
from stoker.producer.dataset.sources.webdataset.index_file import (HEADER, MAGIC, IndexFileRefused,
                                                                   encode_index, parse_index)

TARS, SAMPLES = 2, 8
META = DatasetMeta(count=SAMPLES, fields={"image": FieldKind("image"), "text": FieldKind("str")})


def _write_tar(path: Path, first: int) -> Path:
    with tarfile.open(path, "w") as tar:
        for n in range(first, first + SAMPLES):
            for ext, data in (("jpg", random_jpeg(n, (8, 8, 3))), ("txt", f"caption {n}".encode()),
                              ("json", json.dumps({"n": n}).encode())):
                info = tarfile.TarInfo(f"{n:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def tars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tars")
    for t in range(TARS):
        _write_tar(folder / f"{t:06d}.tar", t * SAMPLES)
    index = index_webdataset([f"{folder}/{{000000..000001}}.tar"], progress=False, fields=["image", "text"])
    (folder / "index.json").write_text(index.to_json())
    os.chmod(folder, 0o555)  # read in place from a read-only folder: nothing is written beside the data
    return folder


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each header walk of a tar an open makes (the real walk, counted)."""
    seen: list[str] = []
    real = tar_shard.index_tar

    def counted(fd: int, where: str, *args):  # type: ignore[no-untyped-def]
        seen.append(where)
        return real(fd, where, *args)
    monkeypatch.setattr(tar_shard, "index_tar", counted)
    return seen


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _all(dataset) -> list[dict]:  # type: ignore[no-untyped-def]
    with dataset:
        return [dataset.read(i) for i in range(len(dataset))]


def test_a_later_open_of_a_tar_in_place_reads_its_kept_index_and_never_walks_it(tars: Path, tmp_path: Path,
                                                                               walks: list[str]) -> None:
    """Two producers' worth of opens (each a fresh dataset, as a new worker process makes): the first walks each
    tar and keeps its index under --cache-dir; the second walks none and reads the same records."""
    options = RemoteOptions(cache_dir=str(tmp_path / "cache"))
    first = _all(open_dataset(tars / "index.json", options))
    assert walks == ["000000.tar", "000001.tar"]
    kept = sorted(p.name for p in (tmp_path / "cache" / "tar-index").iterdir())
    assert kept == sorted(f"{_sha(tars / f'{t:06d}.tar')}.index" for t in range(TARS))
    assert sorted(p.name for p in tars.iterdir()) == ["000000.tar", "000001.tar", "index.json"]
    assert _all(open_dataset(tars / "index.json", options)) == first
    assert walks == ["000000.tar", "000001.tar"]  # not walked again
    assert first[3] == {"image": random_jpeg(3, (8, 8, 3)), "text": "caption 3"}


def test_an_index_that_cannot_be_kept_costs_only_the_walk(tars: Path, tmp_path: Path, walks: list[str]) -> None:
    """No writable cache folder (--cache-dir names a file) or an index file's folder gone: every open walks the tar,
    every record still reads."""
    (tmp_path / "a-file").write_text("")
    options = RemoteOptions(cache_dir=str(tmp_path / "a-file"))
    assert _all(open_dataset(tars / "index.json", options)) == _all(open_dataset(tars / "index.json", options))
    assert len(walks) == 2 * TARS
    missing = tmp_path / "gone" / "x.index"
    path = tars / "000000.tar"
    for _ in range(2):
        with TarShard(path, "000000.tar", META, SAMPLES, index_file=missing, sha256=_sha(path)) as shard:
            assert shard.read(0)["text"] == "caption 0" and shard.walk is not None
    assert len(walks) == 2 * TARS + 2 and not missing.parent.exists()


def test_a_cached_tar_keeps_its_index_beside_it_and_eviction_takes_both(tars: Path, tmp_path: Path,
                                                                         walks: list[str], monkeypatch) -> None:
    """From object storage (file://, a cache of one shard): the index goes in the cached copy's folder, is read by
    the next open, and goes with the copy when it is evicted. A folder an index write left behind as its shard
    was evicted (the write raced the eviction) does not stop the shard being fetched again."""
    from stoker.producer.dataset.sources import sharded as sharded_module

    monkeypatch.setattr(sharded_module, "CHECK_EVICTED_S", 0.0)
    index = json.loads((tars / "index.json").read_text())
    index["root"] = f"file://{tars}"
    (tmp_path / "index.json").write_text(json.dumps(index))
    cache, shas = tmp_path / "cache", [s["sha256"] for s in index["shards"]]
    options = RemoteOptions(cache_dir=str(cache), cache_bytes=max(s["bytes"] for s in index["shards"]) + 4096)
    with open_dataset(tmp_path / "index.json", options) as ds:
        expected = ds.read(0)
        assert (cache / "shards" / shas[0] / "shard.index").is_file() and walks == ["000000.tar"]
    with open_dataset(tmp_path / "index.json", options) as ds:
        assert ds.read(1) == {"image": random_jpeg(1, (8, 8, 3)), "text": "caption 1"} and len(walks) == 1
        ds.read(SAMPLES)  # shard 1 fetched: shard 0 evicted, its index with it
        assert not (cache / "shards" / shas[0]).exists() and (cache / "shards" / shas[1] / "shard.index").is_file()
        (cache / "shards" / shas[0]).mkdir()
        (cache / "shards" / shas[0] / "shard.index").write_bytes(b"left by a write that raced the eviction")
        assert ds.read(0) == expected  # fetched again into a fresh folder, walked again
    assert [f["shard"] for f in fetch_log(cache)] == ["000000.tar", "000001.tar", "000000.tar"]
    assert walks == ["000000.tar", "000001.tar", "000000.tar"]


class _Planted:
    """Unpickled, it would leave a file: proof that an index file is never unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.write_text, (self.marker, "unpickled"))


def _signed(head: bytes, payload: bytes) -> bytes:
    """An index file whose CRC matches (the module doc's layout: the CRC is the header's last 4 bytes)."""
    head = head[:HEADER.size - 4]
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


def _hostile(good: bytes, tmp: Path) -> dict[str, bytes]:
    fields = list(HEADER.unpack_from(good))
    payload = bytearray(good[HEADER.size:])
    members = fields[5]

    def header(**change: int) -> bytes:
        f = list(fields)
        for at, value in change.items():
            f[int(at[1:])] = value
        return HEADER.pack(*f)
    past_eof = bytearray(payload)
    past_eof[8 * (members - 1):8 * members] = struct.pack("<q", fields[2] + 4096)  # the last member's offset
    starts, samples = 12 * members, fields[6]  # the layout: offsets, sizes, starts, key_ends, kinds, ...
    kinds = starts + 4 * (samples + 1) + 4 * samples
    bad_kind = bytearray(payload)
    bad_kind[kinds + 2:kinds + 4] = b"\x09\x00"  # member 1 of extension 9 (of 3)
    back = bytearray(payload)
    back[starts + 4:starts + 8] = b"\x00\x00\x00\x00"  # sample 1 starts where sample 0 does
    np_file = io.BytesIO()
    np.savez(np_file, offsets=np.zeros(3, np.int64))
    return {"offsets past the end of the tar": _signed(good[:HEADER.size], bytes(past_eof)),
            "a kind past the extensions": _signed(good[:HEADER.size], bytes(bad_kind)),
            "samples not increasing": _signed(good[:HEADER.size], bytes(back)),
            "huge counts": _signed(header(_5=2**40, _6=2**40), bytes(payload)),
            "wrong record count": _signed(header(_6=SAMPLES - 1), bytes(payload)),
            "another tar's size": _signed(header(_2=fields[2] + 512), bytes(payload)),
            "a pickle": pickle.dumps(_Planted(tmp / "unpickled")),
            "an npz": np_file.getvalue(),
            "cut short": good[:-5],
            "one byte flipped": good[:200] + bytes([good[200] ^ 1]) + good[201:],
            "empty": b""}


def test_a_damaged_or_hostile_index_file_is_ignored_rebuilt_and_overwritten(tars: Path, tmp_path: Path,
                                                                           walks: list[str]) -> None:
    path, index_file = tars / "000000.tar", tmp_path / "000000.index"
    sha = _sha(path)
    with TarShard(path, "000000.tar", META, SAMPLES, index_file=index_file, sha256=sha) as shard:
        expected = [shard.read(i) for i in range(SAMPLES)]
    good = index_file.read_bytes()
    assert good[:8] == MAGIC and len(walks) == 1
    for what, data in _hostile(good, tmp_path).items():
        index_file.write_bytes(data)
        with TarShard(path, "000000.tar", META, SAMPLES, index_file=index_file, sha256=sha) as shard:
            assert shard.walk is not None, what  # refused, walked again
            assert [shard.read(i) for i in range(SAMPLES)] == expected, what
        assert index_file.read_bytes() == good, what  # overwritten with the whole index
    assert len(walks) == 1 + len(_hostile(good, tmp_path)) and not (tmp_path / "unpickled").exists()
    with TarShard(path, "000000.tar", META, SAMPLES, index_file=index_file, sha256=sha) as shard:
        assert shard.walk is None  # the rewritten file is read


@pytest.fixture(scope="module")
def kept(tars: Path) -> tuple[bytes, os.stat_result, str]:
    path = tars / "000000.tar"
    with TarShard(path, "000000.tar", META, SAMPLES) as shard:
        return encode_index(shard.index, os.stat(path), _sha(path)), os.stat(path), _sha(path)


@settings(max_examples=150, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.integers(-40, 40), resign=st.booleans())
def test_fuzzed_index_files_are_refused_by_name_or_describe_only_bytes_inside_the_tar(
        kept: tuple[bytes, os.stat_result, str], tars: Path, edits: list[tuple[int, int]], cut: int,
        resign: bool) -> None:
    """Bytes of a good file changed, cut or padded, its CRC fixed up or not: the parser raises IndexFileRefused (no
    other error) or gives an index whose every member lies inside the tar, in order; read through ``TarShard``
    such an index yields records or RecordError, nothing else."""
    good, stat, sha = kept
    data = bytearray(good)
    for at, value in edits:
        data[at % len(data)] = value
    data = data[:len(data) + cut] if cut < 0 else data + bytes(cut)
    if resign and len(data) >= HEADER.size:
        data = bytearray(_signed(bytes(data[:HEADER.size]), bytes(data[HEADER.size:])))
    try:
        index = parse_index(bytes(data), stat, sha, SAMPLES)
    except IndexFileRefused:
        return
    ends = index.offsets + index.sizes
    assert len(index) == SAMPLES and int(ends.max()) <= stat.st_size and np.all(ends[:-1] < index.offsets[1:])
    assert int(index.kinds.max()) < len(index.extensions) and index.starts[-1] == len(index.offsets)
    with TarShard(tars / "000000.tar", "000000.tar", META, SAMPLES) as shard:
        shard.index = index
        try:
            shard._fields = shard._fields_of_extensions(META)
        except DatasetError:
            return  # extensions renamed to a field of another kind: the shard is refused, by name
        for i in range(SAMPLES):
            try:
                shard.read(i)
                shard.key(i)
            except RecordError:
                pass

