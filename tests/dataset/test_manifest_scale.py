"""A manifest of 2^20 shards (issue 42, web scale): parsed into columns within a stated memory bound, refused one
shard past MAX_SHARDS by name, and the compact form a daemon hands its workers round-trips and is checked exactly
as the JSON is (hypothesis, against ``parse_manifest`` itself)."""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.producer.dataset.sources import RemoteOptions, open_dataset
from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import (MAX_SHARDS, Manifest, ShardInfo, ShardTable, _lmdb_name_ok,
                                                      _object_path_ok, _shard_ok, parse_manifest)
from stoker.producer.dataset.sources.shard_table.compact import MAGIC, parse_compact

HEAD = '{"format": "stoker-shards", "version": 1, "shard_format": "tar", "root": "s3://b", "count": %d, ' \
       '"fields": {"image": "image", "text": "str"}, "shards": ['
#: what the parsed manifest may keep a shard, traced: its columns are ~90 bytes (name ~14, offset 8, records, bytes
#: and first 24, SHA-256 32), so 128 leaves room for the sorted SHA order a cache adds and nothing per-shard Python
KEPT_BYTES_PER_SHARD = 128
#: the parse's peak a shard: json.loads' dict, strings and ints (~450 bytes) once, dropped before the columns grow
PEAK_BYTES_PER_SHARD = 1024


def index_json(shards: int) -> bytes:
    """A tar index of ``shards`` shards of 10^4 - (i % 7) samples, built as text a few fixed-width columns at once."""
    records = 10_000 - np.arange(shards) % 7
    digests = os.urandom(32 * shards).hex()
    rows = ('{"name":"d/%07d.tar","records":%d,"bytes":%d,"sha256":"%s"}' % (i, r, 5 * 10 ** 8 + i, digests[64 * i:64 * i + 64])
            for i, r in enumerate(records.tolist()))
    return (HEAD % int(records.sum()) + ",".join(rows) + "]}").encode()


@pytest.fixture(scope="module")
def big() -> bytes:
    return index_json(MAX_SHARDS)


def test_two_to_the_twenty_shards_parse_into_columns_within_the_memory_bound(big: bytes) -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        manifest = parse_manifest(big, "big")
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(manifest.shards) == MAX_SHARDS == 1 << 20 and isinstance(manifest.shards, ShardTable)
    assert (kept - before) / MAX_SHARDS < KEPT_BYTES_PER_SHARD, (kept - before) / MAX_SHARDS
    assert (peak - before) / MAX_SHARDS < PEAK_BYTES_PER_SHARD, (peak - before) / MAX_SHARDS
    last = manifest.shards[-1]
    assert (last.name, last.records, manifest.shard_of(manifest.meta.count - 1)) == (f"d/{MAX_SHARDS - 1:07d}.tar",
                                                                                   10_000 - (MAX_SHARDS - 1) % 7,
                                                                                   MAX_SHARDS - 1)
    assert manifest.shards.number_of_sha(last.sha256) == MAX_SHARDS - 1
    compact = manifest.to_compact()
    assert len(compact) < len(big) / 2 and parse_compact(compact, "handed") == manifest


def test_one_shard_past_the_limit_is_refused_naming_it(big: bytes) -> None:
    extra = b',{"name":"d/x.tar","records":1,"bytes":1,"sha256":"' + b"0" * 64 + b'"}]}'
    data = big[:-2] + extra
    count = json.loads(big[:200].split(b'"count": ')[1].split(b",")[0])
    data = data.replace(b'"count": %d' % count, b'"count": %d' % (count + 1), 1)
    with pytest.raises(DatasetError, match=f"1-{MAX_SHARDS} shards"):
        parse_manifest(data, "one too many")


def _manifest(shards: list[tuple[str, int, int, str]], fmt: str) -> Manifest:
    infos = tuple(ShardInfo(name, 0, records, size, sha) for name, records, size, sha in shards)
    count = sum(r for _, r, _, _ in shards)
    return Manifest(DatasetMeta(count=count, fields={"image": FieldKind("image")}), infos, fmt,
                    "s3://b" if fmt != "lmdb" else None)


NAMES = ["shard-00001", "shard-000002", "shard-1", "shard-0000001", "a.tar", "d/b.tar", "../a", "a//b", "./a",
         "a/.", "a/..", "..", ".", "a\\b", "a\x7fb", "a\nb", "/a", "a/", "a" * 1025, "a" * 1024, "x/../y", "x/./y",
         "..a/b..", " a", "shard-0000a", "shard-00001\n", ""]
_names = st.one_of(st.sampled_from(NAMES), st.text(st.sampled_from("ab./\\ -0"), min_size=0, max_size=6))
_shard = st.tuples(_names, st.integers(-1, 10 ** 8 + 1), st.integers(-1, 3),
                   st.binary(min_size=32, max_size=32).map(bytes.hex))


@pytest.mark.parametrize("fmt", ["lmdb", "tar"])
@pytest.mark.parametrize("name", NAMES)
def test_each_name_is_judged_as_the_per_shard_check_judges_it(name: str, fmt: str) -> None:
    test_the_compact_form_is_checked_exactly_as_the_json.hypothesis.inner_test(  # type: ignore[attr-defined]
        [("d/ok.tar" if fmt != "lmdb" else "shard-99999", 1, 1, "00" * 32), (name, 2, 3, "ab" * 32)], fmt)


def test_a_shard_the_columns_cannot_hold_is_named_by_the_per_shard_check() -> None:
    for bad in ({"name": "caf\u00e9.tar"}, {"records": True}, {"bytes": 2 ** 64}, {"sha256": "AB" * 32}, {"name": 7}):
        shard = {"name": "a.tar", "records": 1, "bytes": 1, "sha256": "ab" * 32, **bad}
        data = (HEAD % 2)[:-1] + json.dumps([{"name": "z.tar", "records": 1, "bytes": 1, "sha256": "00" * 32}, shard])
        with pytest.raises(DatasetError, match="shard 1 must be" if "bytes" not in bad else "past 2\\^63"):
            parse_manifest((data + "}").encode(), "x")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_shard, min_size=1, max_size=6), st.sampled_from(["lmdb", "tar", "parquet"]))
def test_the_compact_form_is_checked_exactly_as_the_json(shards: list, fmt: str) -> None:
    """Any shard list, good or not, is accepted by both parsers (and read back equal) or refused by both, and
    accepted exactly where each shard passes the per-shard check (the reference: one regex and test a shard), the
    names are distinct and some shard holds a record."""
    manifest = _manifest(shards, fmt)
    named = _lmdb_name_ok if fmt == "lmdb" else _object_path_ok
    good = (all(_shard_ok({"name": n, "records": r, "bytes": b, "sha256": h}, named) for n, r, b, h in shards)
            and len({n for n, _, _, _ in shards}) == len(shards) and sum(r for _, r, _, _ in shards) > 0)
    results = []
    for parse, data in ((parse_manifest, manifest.to_json().encode()), (parse_compact, manifest.to_compact())):
        try:
            results.append(parse(data, "x"))
        except DatasetError:
            results.append(None)
    assert (results[0] is None) == (results[1] is None) == (not good), (shards, fmt, results)
    if results[0] is not None:
        assert results[0] == results[1] == manifest


@pytest.fixture(scope="module")
def small() -> bytes:
    return _manifest([("a.tar", 3, 10, "ab" * 32), ("d/b.tar", 0, 5, "00" * 32), ("c.tar", 7, 1, "cd" * 32)],
                     "tar").to_compact()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_compact_bytes_are_refused_or_read_as_a_checked_manifest(small: bytes, data: st.DataObject) -> None:
    """Bytes flipped, cut or added anywhere: a DatasetError, or a manifest that passes every check (one whose
    compact form reads back equal); never another exception, nor an allocation a length field asked for."""
    damaged = bytearray(small)
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["flip", "cut", "add", "length"]))
        at = data.draw(st.integers(0, max(0, len(damaged) - 1)))
        if how == "flip" and damaged:
            damaged[at] ^= data.draw(st.integers(1, 255))
        elif how == "cut":
            del damaged[at:]
        elif how == "add":
            damaged[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:  # the header length, or the shard count in the header, made anything
            damaged[len(MAGIC):len(MAGIC) + 4] = data.draw(st.integers(0, 2 ** 32 - 1)).to_bytes(4, "little")
    try:
        parsed = parse_compact(bytes(damaged), "damaged")
    except DatasetError:
        return
    assert parse_compact(parsed.to_compact(), "again") == parsed


def test_a_huge_shard_count_in_the_header_is_refused_before_any_column_is_read(small: bytes) -> None:
    header_len = int.from_bytes(small[len(MAGIC):len(MAGIC) + 4], "little")
    header = json.loads(small[len(MAGIC) + 4:len(MAGIC) + 4 + header_len])
    for n, why in ((MAX_SHARDS + 1, f"1-{MAX_SHARDS}"), (MAX_SHARDS, "cannot hold")):
        text = json.dumps({**header, "shards": n}).encode()
        with pytest.raises(DatasetError, match=why):
            parse_compact(MAGIC + len(text).to_bytes(4, "little") + text + small[len(MAGIC) + 4 + header_len:], "x")


def test_a_worker_opens_the_compact_form_it_was_handed_not_the_file(tmp_path) -> None:
    """What the daemon hands its workers (RemoteOptions.manifest = Manifest.to_compact()) is the layout they read,
    even where the index on disk changed since; JSON handed over is refused (workers never parse JSON again)."""
    handed = _manifest([("a.tar", 3, 10, "ab" * 32), ("b.tar", 4, 10, "cd" * 32)], "tar")
    later = _manifest([("a.tar", 5, 10, "ab" * 32)], "tar")
    (tmp_path / "index.json").write_text(later.to_json())
    with open_dataset(tmp_path / "index.json", RemoteOptions(manifest=handed.to_compact())) as dataset:
        assert dataset.layout == handed and len(dataset) == 7 and dataset.manifest_bytes == handed.to_compact()
    with pytest.raises(DatasetError, match="not a compact Stoker manifest"):
        open_dataset(tmp_path / "index.json", RemoteOptions(manifest=handed.to_json().encode()))
    with open_dataset(tmp_path / "index.json") as dataset:
        assert dataset.layout == later


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=32, max_size=32).map(bytes.hex), min_size=0, max_size=20),
       st.binary(min_size=32, max_size=32).map(bytes.hex))
def test_a_shard_is_found_by_its_sha256_as_a_dict_would_find_it(shas: list, other: str) -> None:
    """The cache's holdings look a shard up by SHA-256 through a sorted order (no dict of 10^6): same answers."""
    table = ShardTable.of([ShardInfo(f"s{i}", 0, 1, 1, h) for i, h in enumerate(shas)])
    for sha in set(shas) | {other, other.upper(), "0" * 63, "zz" * 32}:
        found = table.number_of_sha(sha)
        assert (shas[found] == sha) if found is not None else sha not in shas
    assert len(table) == len(shas) and list(table.first) == list(range(len(shas)))
