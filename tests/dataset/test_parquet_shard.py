"""Parquet shards (issue 42): real Parquet files written with pyarrow the way a Hugging Face image dataset is (an
image struct {bytes, path} of real JPEGs, a caption, a label, several row groups), indexed and read back row by
row; nulls, lying footers, oversized column chunks, wrong row counts, truncations and random byte mutations are
DatasetError or RecordError naming what is wrong, within bounded memory; a row over MAX_RECORD_BYTES is refused;
each dataset owns its decoded row group cache."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import weakref
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import random_jpeg
from stoker.producer.dataset.build.parquet_index import index_parquet
from stoker.producer.dataset.build.webdataset_index import write_index
from stoker.producer.dataset.sources import DatasetError, RecordError, open_dataset
from stoker.producer.dataset.sources import parquet_shard
from stoker.producer.dataset.sources.lmdb_format import DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import ShardInfo
from stoker.producer.dataset.sources.parquet_shard import DecodedGroups, ParquetFormat, ParquetShard, make_format
from stoker.producer.dataset.sources.shard_format import shard_format

ROWS, GROUP = 23, 5  # 5 row groups, the last of 3


def _rows(seed: int, n: int = ROWS) -> list[dict]:
    return [{"image": {"bytes": random_jpeg(seed * 100 + i, (8 + i % 5, 9, 3)), "path": f"{seed}-{i}.jpg"},
             "text": f"a photo {seed}-{i} \u00e9", "label": (seed * 7 + i) % 4, "score": i / 3, "ok": i % 2 == 0,
             "raw": bytes([i]) * i} for i in range(n)]


def _write(path: Path, rows: list[dict], group: int = GROUP, **options) -> Path:
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("text", pa.string()),
                        ("label", pa.int64()), ("score", pa.float32()), ("ok", pa.bool_()), ("raw", pa.binary())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=group, **options)
    return path


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """A Hugging Face-shaped folder: data/train-0000{0,1}-of-00002.parquet."""
    folder = tmp_path_factory.mktemp("hf") / "data"
    folder.mkdir()
    rows = {f"train-0000{k}-of-00002.parquet": _rows(k) for k in range(2)}
    for name, content in rows.items():
        _write(folder / name, content)
    return folder, rows


def _expected(row: dict) -> dict:
    return {"image": row["image"]["bytes"], "text": row["text"], "label": row["label"],
            "score": pytest.approx(row["score"]), "ok": row["ok"], "raw": row["raw"]}


def _meta(fields: dict[str, str], count: int = ROWS) -> DatasetMeta:
    return DatasetMeta(count=count, fields={n: FieldKind(k) for n, k in fields.items()})


FIELDS = {"image": "image", "text": "str", "label": "int", "score": "float", "ok": "bool", "raw": "bytes"}


def _open(path: Path, records: int = ROWS, fields: dict[str, str] = FIELDS) -> ParquetShard:
    return make_format().open(path, ShardInfo(path.name, 0, records, path.stat().st_size, "0" * 64), _meta(fields, records))


def test_the_index_names_each_file_under_the_common_root_with_its_rows_size_and_sha256(hf, tmp_path):
    folder, rows = hf
    manifest = index_parquet(str(folder / "*.parquet"), progress=False)
    assert (manifest.shard_format, manifest.root, manifest.meta.count) == ("parquet", str(folder), 2 * ROWS)
    assert {n: str(k) for n, k in manifest.meta.fields.items()} == FIELDS
    assert manifest.meta.classes == ()
    for shard, name in zip(manifest.shards, sorted(rows)):
        data = (folder / name).read_bytes()
        assert (shard.name, shard.records, shard.bytes, shard.sha256) == (name, ROWS, len(data),
                                                                          hashlib.sha256(data).hexdigest())
    # a folder and a parent glob give the same files, named by their path under the common root
    assert index_parquet(str(folder), progress=False).shards == manifest.shards
    write_index(manifest, str(tmp_path / "index.json"))
    assert json.loads((tmp_path / "index.json").read_text())["shard_format"] == "parquet"


def test_every_row_reads_back_equal_sequentially_and_at_random(hf):
    folder, rows = hf
    for name, content in rows.items():
        shard = _open(folder / name)
        assert len(shard) == ROWS
        assert [shard.read(i) for i in range(ROWS)] == [_expected(r) for r in content]
        order = random.Random(1).sample(range(ROWS), ROWS)
        assert [shard.read(i) for i in order] == [_expected(content[i]) for i in order]
        shard.close()


def test_the_index_refuses_a_column_it_cannot_read_naming_it_and_reads_the_columns_named(tmp_path):
    path = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"tags": pa.array([[1, 2], [3]]), "text": ["a", "b"]}), path)
    with pytest.raises(DatasetError, match="column .tags. is list<element: int64>.*name the columns"):
        index_parquet(str(path), progress=False)
    manifest = index_parquet(str(path), progress=False, columns=["text"], classes=("x",))
    assert (list(manifest.meta.fields), manifest.meta.classes, manifest.shards[0].name) == (["text"], ("x",),
                                                                                            "lists.parquet")


def test_a_null_image_or_caption_is_a_record_error_naming_column_and_row(tmp_path):
    rows = _rows(3, 6)
    rows[2]["image"] = None
    rows[4]["text"] = None
    rows[5]["image"] = {"bytes": None, "path": "gone.jpg"}
    shard = _open(_write(tmp_path / "nulls.parquet", rows), records=6)
    assert shard.read(1)["text"] == rows[1]["text"]
    for row, column in ((2, "image"), (4, "text"), (5, "image")):
        with pytest.raises(RecordError, match=f"column '{column}' is null in row {row}"):
            shard.read(row)
    assert shard.read(3)["label"] == rows[3]["label"]  # the reader goes on after a bad row


def test_a_shard_whose_schema_or_rows_disagree_with_the_manifest_is_refused(hf, tmp_path):
    path = hf[0] / "train-00000-of-00002.parquet"
    with pytest.raises(DatasetError, match=f"holds {ROWS} rows, the manifest says {ROWS + 1}"):
        _open(path, records=ROWS + 1)
    with pytest.raises(DatasetError, match="no column 'caption'"):
        _open(path, fields={"caption": "str"})
    with pytest.raises(DatasetError, match="column 'text' is string .str., the manifest says int"):
        _open(path, fields={"text": "int"})


def test_a_column_chunk_over_the_bound_is_refused_before_a_byte_of_it_is_read(hf, monkeypatch):
    path = hf[0] / "train-00000-of-00002.parquet"
    biggest = max(pq.ParquetFile(path).metadata.row_group(g).column(0).total_uncompressed_size for g in range(5))
    monkeypatch.setattr(parquet_shard, "MAX_CHUNK_BYTES", biggest - 1)
    with pytest.raises(DatasetError, match="column image.bytes claims .* bytes uncompressed"):
        _open(path)
    monkeypatch.setattr(parquet_shard, "MAX_CHUNK_BYTES", biggest)
    monkeypatch.setattr(parquet_shard, "MAX_GROUP_BYTES", biggest)  # the other columns no longer fit beside it
    with pytest.raises(DatasetError, match="holds .* bytes in the columns read"):
        _open(path)
    assert _open(path, fields={"image": "image"}).read(0)["image"]  # the image column alone fits


def _footer_claiming(path: Path, out: Path, old: int, new: int) -> Path:
    """``path`` with one thrift varint in its footer (a size the footer claims) replaced by a larger one."""
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    footer = data[-8 - length:-8]
    def encode(value: int) -> bytes:  # thrift compact: a zigzag varint
        v = value * 2
        return bytes([(v >> (7 * k) & 0x7F) | (0x80 if v >> (7 * (k + 1)) else 0)
                      for k in range(max(1, (v.bit_length() + 6) // 7))])

    assert encode(old) in footer
    footer = footer.replace(encode(old), encode(new), 1)
    out.write_bytes(data[:-8 - length] + footer + len(footer).to_bytes(4, "little") + b"PAR1")
    return out


def test_a_footer_claiming_huge_sizes_or_lengths_is_refused(hf, tmp_path):
    path = hf[0] / "train-00000-of-00002.parquet"
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size
    huge = _footer_claiming(path, tmp_path / "huge.parquet", chunk, 1 << 40)
    with pytest.raises(DatasetError, match="claims 1099511627776 bytes uncompressed"):
        _open(huge)
    data = bytearray(path.read_bytes())
    data[-8:-4] = (1 << 31).to_bytes(4, "little")  # a footer longer than the file
    (tmp_path / "long.parquet").write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="footer of 2147483648 bytes"):
        _open(tmp_path / "long.parquet")


@pytest.mark.parametrize("cut", [1, 5, 100, -9, -1])
def test_a_truncated_file_is_a_dataset_error(hf, tmp_path, cut):
    data = (hf[0] / "train-00000-of-00002.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:cut] if cut > 0 else data[:len(data) + cut])
    with pytest.raises(DatasetError, match="too short|no PAR1"):
        _open(tmp_path / "cut.parquet")


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    path = _write(tmp_path_factory.mktemp("fuzz") / "small.parquet", _rows(5, 8), group=3, compression="snappy")
    return path.read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6))
def test_random_byte_mutations_of_data_pages_are_only_dataset_or_record_errors(small_file, tmp_path, mutations):
    # the data pages only: a mutated footer can abort pyarrow 26 in a metadata accessor (parquet_shard's module
    # doc), which the producer survives because its workers decode and their deaths are supervised
    data = bytearray(small_file)
    pages = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    for where, value in mutations:
        data[where % pages] = value
    path = tmp_path / "mutated.parquet"
    path.write_bytes(bytes(data))
    pool = pa.default_memory_pool()
    try:
        shard = _open(path, records=8)
    except DatasetError:
        return
    for i in range(8):
        try:
            record = shard.read(i)
        except RecordError as exc:
            assert "Parquet shard mutated.parquet" in str(exc)
            continue
        assert set(record) == set(FIELDS)
    shard.close()
    assert pool.max_memory() < 256 * 1024 * 1024  # never near the file's claimed or expanded sizes


def test_a_dictionary_page_repeated_over_many_rows_is_never_expanded(tmp_path):
    big = b"x" * (1 << 18)
    # 2,000 rows of one 256 KiB value: 512 MiB expanded, a dictionary page and its indices on disk (and in the
    # footer's sizes); no arrow schema stored, so only the reader can ask for a dictionary back
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 2000, pa.int32()), pa.array([big], pa.binary()))
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"raw": column}), path, row_group_size=2000, store_schema=False)
    assert path.stat().st_size < 1 << 20
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    shard = _open(path, records=2000, fields={"raw": "bytes"})
    assert shard.read(1999)["raw"] == big
    assert pool.bytes_allocated() - before < 64 << 20
    shard.close()


def test_a_local_parquet_index_reads_every_row_through_open_dataset(hf, tmp_path):
    folder, rows = hf
    index = tmp_path / "index.json"
    write_index(index_parquet(str(folder), progress=False), str(index))
    dataset = open_dataset(index)
    try:
        assert len(dataset) == 2 * ROWS
        expected = [_expected(r) for name in sorted(rows) for r in rows[name]]
        assert [dataset.read(i) for i in range(2 * ROWS)] == expected
    finally:
        dataset.close()


STARTS = list(range(0, ROWS, GROUP))  # each row group's first row


def _open_with(shard_format: ParquetFormat, path: Path) -> ParquetShard:
    return shard_format.open(path, ShardInfo(path.name, 0, ROWS, path.stat().st_size, "0" * 64), _meta(FIELDS))


@pytest.fixture(scope="module")
def group_bytes(hf) -> tuple[int, int]:
    """The smallest and largest decoded row group of the hf files, in bytes, each measured alone."""
    sizes = []
    for name in hf[1]:
        for start in STARTS:
            alone = ParquetFormat(DecodedGroups(1 << 40))
            shard = _open_with(alone, hf[0] / name)
            shard.read(start)
            sizes.append(alone.decoded.nbytes)
            shard.close()
    assert min(sizes) > 0
    return min(sizes), max(sizes)


def test_a_shuffled_pass_decodes_each_row_group_once_and_a_closed_shard_lets_go_of_them(hf):
    folder, rows = hf
    shard_format = ParquetFormat(DecodedGroups(1 << 30))
    shard = _open_with(shard_format, folder / sorted(rows)[0])
    order = random.Random(2).sample(range(ROWS), ROWS)
    assert [shard.read(i) for i in order] == [_expected(rows[sorted(rows)[0]][i]) for i in order]
    assert (shard_format.decoded.decodes, len(shard_format.decoded)) == (len(STARTS), len(STARTS))
    pool = pa.total_allocated_bytes()
    shard.close()
    assert (shard_format.decoded.nbytes, len(shard_format.decoded)) == (0, 0)
    assert pa.total_allocated_bytes() < pool  # the arrays themselves were let go of


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget_groups=st.sampled_from([0, 0.2, 1, 1.5, 2.5, 4, 20]),
       reads=st.lists(st.tuples(st.integers(0, 1), st.integers(0, ROWS - 1)), min_size=1, max_size=60))
def test_reads_in_any_order_over_shards_sharing_one_budget_equal_sequential_within_it(hf, group_bytes,
                                                                                      budget_groups, reads):
    folder, rows = hf
    names, (smallest, largest) = sorted(rows), group_bytes
    budget = int(budget_groups * largest)
    shared = ParquetFormat(DecodedGroups(budget))
    shards = [_open_with(shared, folder / name) for name in names]
    for k, i in reads:
        assert shards[k].read(i) == _expected(rows[names[k]][i])
        # never more than the budget, or the one group just read where it alone is larger
        assert shared.decoded.nbytes <= max(budget, largest)
        decodes = shared.decoded.decodes
        assert shards[k].read(i) == _expected(rows[names[k]][i]) and shared.decoded.decodes == decodes  # kept
    if budget >= 2 * len(STARTS) * largest:  # everything fits: nothing was decoded twice
        assert shared.decoded.decodes == len({(k, i // GROUP) for k, i in reads})
    if budget < smallest:  # one group at a time: each change of group decoded again
        changes = sum(1 for a, b in zip(reads, reads[1:]) if (a[0], a[1] // GROUP) != (b[0], b[1] // GROUP))
        assert (len(shared.decoded), shared.decoded.decodes) == (1, changes + 1)
    for shard in shards:
        shard.close()
    assert (shared.decoded.nbytes, len(shared.decoded)) == (0, 0)


def test_a_row_group_over_the_budget_is_still_read_and_named_once_a_shard(hf, caplog):
    folder, rows = hf
    name = sorted(rows)[1]
    shard_format = ParquetFormat(DecodedGroups(0))
    shard = _open_with(shard_format, folder / name)
    with caplog.at_level("WARNING", logger="stoker.producer"):
        assert [shard.read(i) for i in reversed(range(ROWS))] == [_expected(r) for r in reversed(rows[name])]
    warnings = [r.getMessage() for r in caplog.records if "decodes to" in r.getMessage()]
    assert len(warnings) == 1 and "smaller row groups" in warnings[0] and name in warnings[0]
    assert shard_format.decoded.decodes == len(STARTS) and len(shard_format.decoded) == 1
    shard.close()


def test_a_row_over_the_record_bound_is_a_record_error_naming_shard_row_and_size(tmp_path, monkeypatch):
    rows = _rows(4, 6)
    rows[3]["raw"] = b"r" * 700  # with its image and text, row 3 alone passes the bound set below
    path = _write(tmp_path / "big.parquet", rows, group=3)
    sizes = [len(r["image"]["bytes"]) + len(r["text"].encode()) + len(r["raw"]) for r in rows]
    bound = sorted(sizes)[-2]  # the second largest row fits exactly; the largest is over
    assert sizes.index(max(sizes)) == 3 and max(sizes) > bound
    monkeypatch.setattr(parquet_shard, "MAX_RECORD_BYTES", bound)
    shard = _open(path, records=6)
    with pytest.raises(RecordError, match=f"Parquet shard big.parquet .*row 3 .*holds {sizes[3]} bytes.*more than "
                                          f"{bound}"):
        shard.read(3)
    assert [shard.read(i) for i in (0, 1, 2, 4, 5)] == [_expected(rows[i]) for i in (0, 1, 2, 4, 5)]
    shard.close()


def test_each_dataset_opened_owns_its_decoded_row_groups_and_frees_them_with_it(hf, tmp_path):
    index = tmp_path / "index.json"
    write_index(index_parquet(str(hf[0]), progress=False), str(index))
    assert shard_format("parquet") is not shard_format("parquet") and shard_format("tar") is shard_format("tar")
    first, second = open_dataset(index), open_dataset(index)
    first.read(0)
    assert first.format is first.source.format  # one format a dataset: no second cache made beside the source's
    assert first.format.decoded is not second.format.decoded
    assert (len(first.format.decoded), len(second.format.decoded)) == (1, 0)  # one dataset's reads fill its own
    cache = weakref.ref(first.format.decoded)
    first.close()
    second.close()
    del first
    gc.collect()
    assert cache() is None  # nothing outside the dataset held its cache
