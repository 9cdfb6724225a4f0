"""WebDataset tar shards (issue 42): real tars written as img2dataset writes them (Python's tarfile), indexed by
``index_webdataset`` and read back through ``tar_shard.FORMAT``; hostile tars bounded and named; a fuzz of the
header walk."""

from __future__ import annotations

import io
import json
import os
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_jpeg
from stoker.producer.dataset.build.webdataset_index import expand_braces, index_tar_stream, index_webdataset
from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind, RecordError
from stoker.producer.dataset.sources.record_codec import check_value, kind_of
from stoker.producer.dataset.sources.tar_shard import FORMAT, TarShard, index_tar
from stoker.producer.dataset.sources.webdataset.headers import TarLimits

TARS, SAMPLES = 3, 12
FIELDS = {"image": FieldKind("image"), "text": FieldKind("str"), "json": FieldKind("map"), "label": FieldKind("int")}
META = DatasetMeta(count=SAMPLES, fields=FIELDS)


def _sample(number: int) -> dict[str, bytes]:
    """The members img2dataset writes for one sample (plus a .cls label)."""
    return {"jpg": random_jpeg(number, (16 + number % 5, 24, 3)), "txt": f"a caption, naïve {number}".encode(),
            "json": json.dumps({"key": f"{number:09d}", "caption": f"c{number}", "width": 24}).encode(),
            "cls": str(number % 4).encode()}


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return path


def _members(first: int, count: int) -> list[tuple[str, bytes]]:
    return [(f"{n:09d}.{ext}", data) for n in range(first, first + count) for ext, data in _sample(n).items()]


@pytest.fixture(scope="module")
def tars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wds")
    for t in range(TARS):
        _write_tar(folder / f"{t:06d}.tar", _members(t * SAMPLES, SAMPLES))
    return folder


def _expected(number: int) -> dict:
    s = _sample(number)
    return {"image": s["jpg"], "text": s["txt"].decode(), "json": json.loads(s["json"]), "label": number % 4}


def test_an_index_of_img2dataset_tars_reads_every_sample_back_as_written(tars: Path) -> None:
    manifest = index_webdataset([f"{tars}/{{000000..000002}}.tar"], progress=False)
    assert (manifest.shard_format, manifest.root, [s.name for s in manifest.shards]) == (
        "tar", str(tars), ["000000.tar", "000001.tar", "000002.tar"])
    assert {n: k.kind for n, k in manifest.meta.fields.items()} == {"image": "image", "text": "str", "json": "map",
                                                                   "label": "int"}
    assert manifest.meta.classes == ("0", "1", "2", "3") and manifest.meta.class_counts == (9, 9, 9, 9)
    for info in manifest.shards:
        assert info.bytes == (tars / info.name).stat().st_size
        with FORMAT.open(tars / FORMAT.object_name(info.name), info, manifest.meta) as shard:
            got = [shard.read(i) for i in range(len(shard))]
            assert [shard.key(i) for i in range(len(shard))] == [f"{n:09d}" for n in range(info.first, info.first + 12)]
        assert got == [_expected(n) for n in range(info.first, info.first + SAMPLES)]


def test_samples_are_grouped_as_the_webdataset_library_groups_them(tars: Path) -> None:
    # CI installs it (the test extra): there a missing one is an error, not a skip
    webdataset = pytest.importorskip("webdataset") if not os.environ.get("CI") else __import__("webdataset")
    theirs = [(s["__key__"], sorted(k for k in s if not k.startswith("__")))
              for s in webdataset.WebDataset(str(tars / "000001.tar"), shardshuffle=False)]
    with TarShard(tars / "000001.tar", "000001.tar", META) as shard:
        ours = [(shard.key(i), sorted(f"{e}" for e in ("cls", "jpg", "json", "txt"))) for i in range(len(shard))]
    assert ours == theirs


def test_a_truncated_tar_keeps_its_whole_samples_and_is_refused_only_against_the_manifest(tars: Path,
                                                                                        tmp_path: Path) -> None:
    data = (tars / "000000.tar").read_bytes()
    cut = tmp_path / "cut.tar"
    with TarShard(tars / "000000.tar", "whole", META) as shard:  # cut inside sample 5's .json member
        cut.write_bytes(data[:int(shard.index.offsets[5 * 4 + 2]) + 3])
    with TarShard(cut, "cut.tar", META) as shard:
        assert len(shard) == 5 and "reaching past the end of the file" in shard.walk.ended
        assert shard.read(4) == _expected(4)
    with pytest.raises(DatasetError, match=r"cut.tar holds 5 whole samples, the manifest says 12.*unreadable from byte"):
        TarShard(cut, "cut.tar", META, records=SAMPLES)
    assert index_tar_stream(io.BytesIO(cut.read_bytes()), "cut.tar")["records"] == 5  # the stream walk agrees


def _header(name: str, size_field: bytes, kind: bytes = b"0") -> bytes:
    """A tar header with the raw ``size_field`` and a correct checksum (a lie the checksum cannot catch)."""
    block = bytearray(tarfile.TarInfo(name).tobuf(tarfile.USTAR_FORMAT))
    block[124:136], block[156:157] = size_field.ljust(12, b"\0")[:12], kind
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


@pytest.mark.parametrize("size_field, reason, kept", [
    (b"77777777777", "reaching past the end", 4),  # 8 GiB claimed; a member of a new key: sample 3 was whole
    (b"\xff" * 12, "negative or garbled", 3),  # GNU base-256, negative: whose member it is is unknown
    (b"12x4", "not octal", 3),
])
def test_a_lying_or_garbled_size_ends_the_walk_named_and_keeps_what_came_before(tars: Path, tmp_path: Path,
                                                                                size_field: bytes, reason: str,
                                                                                kept: int) -> None:
    whole = (tars / "000000.tar").read_bytes()
    with TarShard(tars / "000000.tar", "t", META) as shard:
        end = int(shard.index.offsets[3 * 4 + 3]) + 512  # after sample 3's .cls member
    path = tmp_path / "lie.tar"
    path.write_bytes(whole[:end] + _header("000000099.jpg", size_field) + b"x" * 700)
    with TarShard(path, "lie.tar", META) as shard:
        assert len(shard) == kept and reason in shard.walk.ended and "lie.tar" in shard.walk.ended


def test_a_huge_member_a_symlink_and_a_folder_are_passed_over_and_counted_never_followed(tmp_path: Path) -> None:
    path = _write_tar(tmp_path / "odd.tar", [(n, d if n != "000000000.jpg" else b"\xff" * 100_000)
                                             for n, d in _members(0, 2)])
    with tarfile.open(path, "a") as tar:
        link = tarfile.TarInfo("000000002.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
        folder = tarfile.TarInfo("000000003")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    shard = TarShard(path, "odd.tar", META, limits=TarLimits(member_bytes=50_000))
    assert len(shard) == 2 and shard.walk.skipped == 3, shard.walk.problems
    assert [p.split(": ", 2)[1:] for p in shard.walk.problems] == [
        ["member '000000000.jpg'", "100000 bytes, more than 50000"],
        ["member '000000002.jpg'", "not a regular file (a link, folder, device or sparse file: never followed)"],
        ["member '000000003/'", "not a regular file (a link, folder, device or sparse file: never followed)"]]
    with pytest.raises(RecordError, match=r"odd.tar:000000000.*no field 'image'"):
        shard.read(0)
    shard.close()


@pytest.mark.parametrize("ext, data, match", [
    ("json", b"[" * 40 + b"]" * 40, "nested 40 deep"),
    ("json", b'{"a": "' + b"[" * 100 + b'"}', None),  # brackets inside a string do not count
    ("json", b"[1, 2]", "not an object"),
    ("json", b'{"a": NaN}', "not JSON"),
    ("txt", b"caption \xff\xfe", "not UTF-8"),
    ("cls", b"12a", "not an ASCII integer"),
    ("cls", b"2000000", "outside"),
    ("jpg", b"", "empty"),
])
def test_a_bad_member_is_a_record_error_naming_the_sample_and_field(tmp_path: Path, ext: str, data: bytes,
                                                                    match: str | None) -> None:
    members = [(n, d) for n, d in _members(0, 2) if not (n.startswith("000000001") and n.endswith("." + ext))]
    path = _write_tar(tmp_path / "bad.tar", members + [(f"000000001.{ext}", data)])
    with TarShard(path, "bad.tar", META, records=2) as shard:
        assert shard.read(0) == _expected(0)
        if match is None:
            assert shard.read(1)["json"] == {"a": "[" * 100}
            return
        with pytest.raises(RecordError, match=rf"bad.tar:000000001.*field '\w+': .*{match}"):
            shard.read(1)


def test_a_manifest_giving_a_tar_field_another_kind_is_refused_at_open(tars: Path) -> None:
    meta = DatasetMeta(count=SAMPLES, fields={**FIELDS, "label": FieldKind("str")})
    with pytest.raises(DatasetError, match="field 'label' a str, but .cls members are int"):
        TarShard(tars / "000000.tar", "000000.tar", meta)


def test_a_hundred_thousand_empty_members_index_in_bounded_memory(tmp_path: Path) -> None:
    template = bytearray(tarfile.TarInfo("000000000.txt").tobuf(tarfile.USTAR_FORMAT))
    blocks = bytearray()
    for n in range(100_000):  # headers made by hand: tarfile would take seconds
        block = bytearray(template)
        block[:9] = b"%09d" % n
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % sum(block)
        blocks += block
    path = tmp_path / "many.tar"
    path.write_bytes(bytes(blocks) + b"\0" * 1024)
    meta = DatasetMeta(count=1, fields={"text": FieldKind("str")})
    tracemalloc.start()
    try:
        shard = TarShard(path, "many.tar", meta, records=100_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, f"indexing 10^5 members peaked at {peak / 2**20:.1f} MiB"
    assert shard.read(99_999) == {"text": ""} and shard.key(12_345) == "000012345"
    shard.close()
    with pytest.raises(DatasetError, match="more than 1000 members"):
        TarShard(path, "many.tar", meta, records=100_000, limits=TarLimits(members=1000))


@pytest.fixture(scope="module")
def small_tar(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    members = [(n, d[:40]) for n, d in _members(0, 3)] + [("x" * 150 + "/k.txt", b"long name")]
    return _write_tar(tmp_path_factory.mktemp("fuzz") / "f.tar", members).read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_the_header_walk_never_raises_anything_but_its_own_errors(small_tar: bytes, tmp_path: Path,
                                                                        data: st.DataObject) -> None:
    tar = bytearray(small_tar)
    headers = [i for i in range(0, len(tar), 512) if tar[i + 257:i + 262] == b"ustar"]
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):  # a header's field changed and its checksum made right: the walk must cope
            at = data.draw(st.sampled_from(headers))
            tar[at + data.draw(st.sampled_from([0, 5, 99, 124, 125, 130, 135, 156, 345]))] = data.draw(
                st.sampled_from([0, 0x30, 0x37, 0x80, 0xFF, ord("x"), ord("L"), ord("2"), ord("/"), ord(".")]))
            tar[at + 148:at + 156] = b" " * 8
            tar[at + 148:at + 156] = b"%06o\0 " % sum(tar[at:at + 512])
        else:
            tar[data.draw(st.integers(0, len(tar) - 1))] = data.draw(st.integers(0, 255))
    tar = tar[:data.draw(st.integers(0, len(tar)))]
    path = tmp_path / "fuzz.tar"
    path.write_bytes(bytes(tar))
    fd = os.open(path, os.O_RDONLY)
    try:
        index, walk = index_tar(fd, "fuzz.tar", TarLimits(members=64))
    finally:
        os.close(fd)
    assert len(index) <= 64 and (index.offsets + index.sizes <= len(tar)).all()
    streamed = index_tar_stream(io.BytesIO(bytes(tar)), "fuzz.tar")
    assert streamed["records"] == len(index) and streamed["bytes"] == len(tar)
    try:
        with TarShard(path, "fuzz.tar", META) as shard:
            for i in range(len(shard)):
                try:
                    shard.read(i)
                except RecordError:
                    pass
    except DatasetError:
        pass


def test_brace_lists_expand_as_webdataset_writes_them_and_are_bounded() -> None:
    assert expand_braces("s3://b/{000008..000010}.tar") == ["s3://b/000008.tar", "s3://b/000009.tar",
                                                            "s3://b/000010.tar"]
    assert expand_braces("d/{a,b}-{0..1}.tar") == ["d/a-0.tar", "d/a-1.tar", "d/b-0.tar", "d/b-1.tar"]
    with pytest.raises(DatasetError, match="more than 1048576"):  # manifest.MAX_SHARDS, counted before expanding
        expand_braces("{0..1023}-{0..1024}.tar")


def test_a_map_field_is_plain_json_for_the_lmdb_writer_too() -> None:
    assert kind_of({"a": [1, {"b": None}]}).kind == "map"
    assert check_value("json", {"a": 1}, FieldKind("map")) is None
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["a"] = node = {}
    assert "nests more than 32" in check_value("json", deep, FieldKind("map"))
    assert "JSON values only" in check_value("json", {"a": b"bytes"}, FieldKind("map"))
    with pytest.raises(ValueError, match="keys must be strings"):
        kind_of({1: 2})


def test_stoker_data_index_writes_an_index_beside_the_tars_and_names_what_it_passed_over(tars: Path,
                                                                                      tmp_path: Path) -> None:
    from conftest import stoker_cli
    from stoker.producer.dataset.sources.manifest import parse_manifest

    out = tmp_path / "index.json"
    done = stoker_cli("data", "index", "--webdataset", f"{tars}/*.tar", "--out", str(out), "--fields", "image,text")
    assert done.returncode == 0, done.stderr
    manifest = parse_manifest(out.read_bytes(), str(out))
    assert (manifest.meta.count, list(manifest.meta.fields), manifest.root) == (TARS * SAMPLES, ["image", "text"],
                                                                               str(tars))
    assert f"indexed {TARS * SAMPLES} samples in {TARS} tars" in done.stdout
    assert [line.split(":")[0] for line in done.stderr.splitlines() if line.startswith("[")] == \
        [f"[{t + 1}/{TARS}] {t:06d}.tar" for t in range(TARS)]  # the progress names each tar
    refused = stoker_cli("data", "index", "--webdataset", f"{tmp_path}/none-*.tar", "--out", str(out))
    assert refused.returncode != 0 and "no tar there" in refused.stderr


def test_a_local_tar_index_reads_every_sample_through_open_dataset(tars: Path, tmp_path: Path) -> None:
    from stoker.producer.dataset.sources import open_dataset

    index = tmp_path / "elsewhere" / "index.json"
    index.parent.mkdir()
    index.write_text(index_webdataset([str(tars)], progress=False).to_json())
    with open_dataset(index) as dataset:
        assert len(dataset) == TARS * SAMPLES
        assert [dataset.read(i) for i in range(len(dataset))] == [_expected(n) for n in range(TARS * SAMPLES)]


def test_a_member_only_some_samples_have_is_left_out_of_the_fields_named_unless_asked_for(tmp_path: Path) -> None:
    """img2dataset writes a .json only for some samples when metadata failed: as a field, it would cost every
    sample without it. The index leaves such an extension out, names it with its count, and serves every sample;
    asked for by name, it is kept and each sample without it is a RecordError naming it."""
    from stoker.producer.dataset.sources import open_dataset

    members = [(f"{n:09d}.{ext}", data) for n in range(6) for ext, data in _sample(n).items()
               if ext != "json" or n % 2 == 0]
    _write_tar(tmp_path / "000000.tar", members)
    manifest = index_webdataset([str(tmp_path / "000000.tar")], progress=False)
    assert set(manifest.meta.fields) == {"image", "text", "label"}
    assert manifest.meta.info["partial_fields"] == {"json": 3}
    index = tmp_path / "index.json"
    index.write_text(manifest.to_json())
    with open_dataset(index) as dataset:
        assert [dataset.read(n)["text"] for n in range(6)] == [_expected(n)["text"] for n in range(6)]
    asked = index_webdataset([str(tmp_path / "000000.tar")], progress=False, fields=["image", "json"])
    index.write_text(asked.to_json())
    with open_dataset(index) as dataset:
        assert dataset.read(0)["json"] == _expected(0)["json"]
        with pytest.raises(RecordError, match="json"):
            dataset.read(1)


def test_a_run_of_pax_headers_before_one_member_is_bounded_as_one_header_is(tmp_path: Path) -> None:
    """Extended headers are each at most 64 KiB, but a run of them before one member once merged into one dict
    without bound (a 20 MB tar of 300 pax headers peaked at 185 MB): the run is bounded as a whole and the walk ends
    named, keeping the whole samples before it (the one it cut is dropped, as in a truncated tar)."""
    content = _write_tar(tmp_path / "plain.tar", _members(0, 2)).read_bytes()
    end = len(content)
    while content[end - 512:end] == bytes(512):  # before the zero blocks that end the tar
        end -= 512
    records = b"".join(_pax_record(f"k{n:07d}", "v") for n in range(3000))  # ~45 KB: under the 64 KiB bound
    path = tmp_path / "pax.tar"
    path.write_bytes(content[:end] + _pax_header(records) * 4 + content[end:])  # together past it
    tracemalloc.start()
    try:
        with TarShard(path, "pax.tar", META) as shard:
            assert len(shard) == 1
            assert "extended headers of" in shard.walk.ended
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n"
    length = len(body) + 1
    length += len(str(length)) - 1
    while len(f"{length}{body}") != length:
        length += 1
    return f"{length}{body}".encode()


def _pax_header(records: bytes) -> bytes:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(records)
    return info.tobuf(tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512)
