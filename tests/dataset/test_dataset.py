"""The LMDB format and the build/synth/info tools, on real files."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import cv2
import lmdb
import msgpack
import numpy as np
import pytest

from stoker.producer.dataset.sources import DatasetError, LmdbDataset, RecordError
from stoker.producer.dataset.sources.lmdb_format import META_KEY
from stoker.producer.dataset.build.lmdb_writer import DatasetWriter
from stoker.producer.dataset.build.builder import build_lmdb
from stoker.producer.images.decode import decode_rgb
from stoker.producer.dataset.build.synthetic import build_synthetic, synthetic_jpeg

from conftest import stoker_cli, random_jpeg

from image_samples import FORMATS, bomb, encode, pattern_image, real_png_bomb


_jpeg = functools.partial(random_jpeg, shape=(40, 50, 3))


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    src = tmp_path / "train"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for i in range(3):
            (src / cls / f"{i}.jpg").write_bytes(_jpeg(hash((cls, i)) % 1000))
    png = cv2.imencode(".png", np.zeros((10, 10, 3), np.uint8))[1].tobytes()
    (src / "dog" / "ok.png").write_bytes(png)
    (src / "cat" / "truncated.jpg").write_bytes(_jpeg(99)[:300])
    (src / "cat" / "garbage.jpg").write_bytes(b"this is not an image")
    (src / "dog" / "notes.txt").write_text("ignored: not an image suffix")
    return src


def test_folder_build_keeps_encoded_bytes_and_skips_corrupt_files_by_path(image_folder, tmp_path):
    out = tmp_path / "out"
    report = build_lmdb(image_folder, out, progress=False)
    assert sorted(Path(p).name for p, _ in report.skipped) == ["garbage.jpg", "notes.txt", "truncated.jpg"]
    with LmdbDataset(out) as ds:
        assert ds.meta.count == 7 and ds.meta.classes == ("cat", "dog")
        labels = [ds.read(i)["label"] for i in range(len(ds))]
        assert labels == [0, 0, 0, 1, 1, 1, 1]
        # Records are the source files byte for byte (sorted order within a class).
        assert ds.read(0)["image"] == (image_folder / "cat" / "0.jpg").read_bytes()


def test_cli_build_reports_skipped_files_and_counts(image_folder, tmp_path):
    result = stoker_cli("lmdb", "build", str(image_folder), str(tmp_path / "out"), "--quiet")
    assert result.returncode == 0, result.stderr
    assert "wrote 7 records in 2 classes" in result.stdout and "skipped 3 files" in result.stdout
    assert "garbage.jpg: the 20 image bytes are not a JPEG, PNG, WebP, BMP, GIF or TIFF image" in result.stdout
    assert "truncated.jpg: truncated JPEG" in result.stdout
    assert "notes.txt: the 28 image bytes are not a JPEG" in result.stdout


@pytest.fixture(scope="session")
def png_bomb() -> bytes:
    return real_png_bomb(10000)


def test_folder_build_takes_every_format_by_content_and_names_every_file_it_leaves_out(tmp_path, png_bomb):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b" / "nested").mkdir(parents=True)
    rgb = pattern_image()
    for fmt in FORMATS:  # every format the producers decode, whatever the file is called
        (src / "a" / f"img.{fmt}").write_bytes(encode(fmt, rgb))
    (src / "b" / "nested" / "no_extension").write_bytes(encode("png", rgb))
    (src / "b" / "UPPER.PNG").write_bytes(encode("png", rgb))
    leave_out = {
        "a/notes.txt": "not a JPEG, PNG, WebP, BMP, GIF or TIFF image",
        "b/huge.png": "10000x10000 pixels, more than the 67108864 (8192x8192) pixels Stoker decodes",
        "README.md": "not inside a class folder",
        "b/dangling.jpg": "broken symbolic link",
    }
    for fmt in FORMATS:  # a header claiming 20000 x 20000 in every format
        (src / "b" / f"bomb.{fmt}").write_bytes(bomb(fmt))
        leave_out[f"b/bomb.{fmt}"] = "pixels Stoker decodes"
    (src / "a" / "notes.txt").write_text("train/val split: 90/10\n")
    (src / "b" / "huge.png").write_bytes(png_bomb)  # a real, valid 10000 x 10000 PNG of 0.3 MB
    (src / "README.md").write_text("my dataset\n")
    (src / "b" / "dangling.jpg").symlink_to(src / "gone.jpg")
    report = build_lmdb(src, tmp_path / "out", progress=False)
    skipped = {str(Path(p).relative_to(src)): reason for p, reason in report.skipped}
    assert set(skipped) == set(leave_out)
    for path, reason in leave_out.items():
        assert reason in skipped[path], path
    with LmdbDataset(tmp_path / "out") as ds:
        assert ds.meta.count == len(FORMATS) + 2 and ds.meta.classes == ("a", "b")
        for index in range(len(ds)):
            decoded = decode_rgb(ds.read(index)["image"])
            assert decoded.shape == rgb.shape and np.abs(decoded.astype(int) - rgb).mean() < 40
    result = stoker_cli("lmdb", "build", str(src), str(tmp_path / "out2"), "--quiet")
    assert f"skipped {len(leave_out)} files" in result.stdout
    for path in leave_out:
        assert str(src / path) in result.stdout


def test_list_file_build(tmp_path):
    (tmp_path / "imgs").mkdir()
    lines = []
    for i in range(4):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(_jpeg(i))
        lines.append(f"imgs/{i}.jpg {i % 3}")
    lines.append("imgs/missing.jpg 1")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    report = build_lmdb(tmp_path / "list.txt", tmp_path / "out", progress=False)
    assert report.meta.count == 4 and len(report.meta.classes) == 3
    assert report.skipped[0][0].endswith("missing.jpg") and "unreadable" in report.skipped[0][1]


def test_failed_build_leaves_no_dataset_that_looks_complete(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with DatasetWriter(out) as writer:
            writer.add({"image": _jpeg(1), "label": 0})
            raise RuntimeError("simulated crash mid-build")
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    # A partial directory from a hard crash has no metadata and is refused clearly.
    partial = tmp_path / "crashed"
    env = lmdb.open(str(partial), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"00000000", b"x")
    env.close()
    with pytest.raises(DatasetError, match="build did not finish"):
        LmdbDataset(partial)


def test_other_format_version_is_refused_with_a_clear_message(tmp_path):
    build_synthetic(tmp_path / "ds", 2, progress=False)
    env = lmdb.open(str(tmp_path / "ds"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(META_KEY, msgpack.packb({"format": "stoker-lmdb", "version": 3, "count": 2, "classes": ["a"]}))
    env.close()
    with pytest.raises(DatasetError, match="format version 3, this Stoker reads versions 1, 2"):
        LmdbDataset(tmp_path / "ds")


def test_missing_lmdb_path_says_how_to_make_one(tmp_path):
    with pytest.raises(DatasetError, match="stoker lmdb synth"):
        LmdbDataset(tmp_path / "nope")
    result = stoker_cli("lmdb", "info", str(tmp_path / "nope"))
    assert result.returncode == 2 and "no LMDB at" in result.stderr and "Traceback" not in result.stderr


def test_corrupt_record_raises_record_error_naming_the_key(tmp_path):
    build_synthetic(tmp_path / "ds", 3, progress=False)
    env = lmdb.open(str(tmp_path / "ds"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"00000001", b"\xc1\xc1")
    env.close()
    with LmdbDataset(tmp_path / "ds") as ds:
        with pytest.raises(RecordError, match="record 00000001"):
            ds.read(1)


def test_synthetic_dataset_is_deterministic_and_photo_sized():
    sizes = []
    for i in range(8):
        first, label = synthetic_jpeg(3, i, 10)
        assert synthetic_jpeg(3, i, 10) == (first, label)
        image = cv2.imdecode(np.frombuffer(first, np.uint8), cv2.IMREAD_COLOR)
        assert 300 <= image.shape[0] <= 500 and 300 <= image.shape[1] <= 500
        sizes.append(len(first))
    assert 50_000 < np.mean(sizes) < 150_000  # ImageNet averages ~110 KB per JPEG


def test_info_prints_count_classes_version_and_samples(synth_lmdb):
    result = stoker_cli("lmdb", "info", str(synth_lmdb), "--samples", "3")
    assert result.returncode == 0, result.stderr
    assert "records:  96" in result.stdout and "version 2" in result.stdout
    assert "fields:   image (image), label (int)" in result.stdout
    assert result.stdout.count("jpeg") == 3


def test_stage_benchmark_skips_undecodable_records_as_the_workers_do(synth_lmdb, tmp_path):
    import shutil

    from stoker.producer.measure.stage_bench import measure_stages

    ds = tmp_path / "ds"
    shutil.copytree(synth_lmdb, ds)
    env = lmdb.open(str(ds), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"00000001", msgpack.packb({"label": 0, "image": bomb("png")}))
        txn.put(b"00000002", b"\xc1 not msgpack")
    env.close()
    rates = measure_stages(str(ds), image_size=32, batch_size=4, seconds=0.05, records=8)
    assert rates.skipped == 2 and rates.pipeline > 0
    assert "2 corrupt or undecodable records skipped" in rates.table()


def test_write_lmdb_stores_any_fields_and_reports_bad_records_by_position(tmp_path):
    from stoker.producer.dataset.build.write_records import write_lmdb

    jpeg = _jpeg(1)

    def records():
        for i in range(6):
            record = {"image": jpeg, "boxes": np.full((i % 3, 4), i, np.float32), "classes": [i, i + 1],
                      "score": 0.5 * i, "name": f"r{i}", "ok": i % 2 == 0, "raw": b"\x00\x01"}
            if i == 2:
                record["boxes"] = record["boxes"].astype(np.float64)  # wrong dtype for the schema
            if i == 3:
                record["image"] = b"not an image"
            if i == 4:
                del record["name"]
            yield record

    report = write_lmdb(tmp_path / "ds", records(), progress=False, task="detection", info={"source": "test"})
    assert [p for p, _ in report.skipped] == ["record 2", "record 3", "record 4"]
    reasons = dict(report.skipped)
    assert "field 'boxes' is float64 rank 2, the dataset's schema says array float32 rank 2" in reasons["record 2"]
    assert "not a JPEG, PNG" in reasons["record 3"] and "missing ['name']" in reasons["record 4"]
    with LmdbDataset(tmp_path / "ds") as ds:
        assert len(ds) == 3 and ds.meta.task == "detection" and ds.meta.info == {"source": "test"}
        assert {n: str(k) for n, k in ds.meta.fields.items()} == {
            "image": "image", "boxes": "array float32 rank 2", "classes": "list", "score": "float", "name": "str",
            "ok": "bool", "raw": "bytes"}
        record = ds.read(2)  # the sixth record
        assert record["boxes"].dtype == np.float32 and record["boxes"].shape == (2, 4) and (record["boxes"] == 5).all()
        assert record["classes"] == [5, 6] and record["name"] == "r5" and record["raw"] == b"\x00\x01"


def test_write_lmdb_publishes_nothing_when_the_records_fail_midway(tmp_path):
    from stoker.producer.dataset.build.write_records import write_lmdb

    def records():
        yield {"image": _jpeg(1), "label": 0}
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        write_lmdb(tmp_path / "ds", records(), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_arrays_in_records_are_validated_when_read_never_unpickled(tmp_path):
    from stoker.producer.dataset.sources.lmdb_format import ARRAY_EXT
    from stoker.producer.dataset.build.write_records import write_lmdb

    write_lmdb(tmp_path / "ds", [{"a": np.arange(6, dtype=np.int32).reshape(2, 3)}] * 3, progress=False)
    bad = {
        1: msgpack.ExtType(ARRAY_EXT, msgpack.packb(["object", [2]]) + b"\x00" * 16),
        2: msgpack.ExtType(ARRAY_EXT, msgpack.packb(["int32", [2, 3]]) + b"\x00" * 5),  # short
    }
    env = lmdb.open(str(tmp_path / "ds"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for index, value in bad.items():
            txn.put(b"%08d" % index, msgpack.packb({"a": value}))
    env.close()
    with LmdbDataset(tmp_path / "ds") as ds:
        assert ds.read(0)["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
        with pytest.raises(RecordError, match="dtype 'object' is not one of"):
            ds.read(1)
        with pytest.raises(RecordError, match=r"needs 24 bytes, the record holds 5"):
            ds.read(2)


def test_jsonl_build_reads_image_paths_and_keeps_json_values(tmp_path):
    (tmp_path / "img").mkdir()
    lines = []
    for i in range(3):
        (tmp_path / "img" / f"{i}.png").write_bytes(encode("png", pattern_image()))
        lines.append(json.dumps({"image": f"img/{i}.png", "boxes": [[1, 2, 10, 20]] * (i + 1), "classes": [i] * (i + 1)}))
    lines.insert(1, "{not json")
    lines.append(json.dumps({"image": "img/missing.png", "boxes": [], "classes": []}))
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    result = stoker_cli("lmdb", "build", "--jsonl", str(tmp_path / "train.jsonl"), str(tmp_path / "out"), "--quiet",
                     "--task", "detection")
    assert result.returncode == 0, result.stderr
    assert "wrote 3 records to" in result.stdout and "skipped 2 lines" in result.stdout
    assert f"{tmp_path / 'train.jsonl'}:2: not a JSON object" in result.stdout
    assert f"{tmp_path / 'train.jsonl'}:5: unreadable" in result.stdout
    info = stoker_cli("lmdb", "info", str(tmp_path / "out"), "--samples", "3")
    assert "task:     detection" in info.stdout and "fields:   image (image), boxes (list), classes (list)" in info.stdout
    assert "boxes: [[1, 2, 10, 20], [1, 2, 10, 20]]" in info.stdout and "png" in info.stdout


def test_a_version_1_dataset_is_still_read_as_image_and_label(tmp_path):
    path = tmp_path / "v1"
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(3):
            txn.put(b"%08d" % i, msgpack.packb({"label": i % 2, "image": _jpeg(i)}, use_bin_type=True))
        txn.put(b"%08d" % 3, msgpack.packb({"label": 7, "image": _jpeg(3)}, use_bin_type=True))  # label out of range
        txn.put(META_KEY, msgpack.packb({"format": "stoker-lmdb", "version": 1, "count": 4, "classes": ["a", "b"]}))
    env.close()
    with LmdbDataset(path) as ds:
        assert ds.meta.version == 1 and list(ds.meta.fields) == ["image", "label"] and ds.meta.classes == ("a", "b")
        assert ds.read(1) == {"label": 1, "image": _jpeg(1)}
        with pytest.raises(RecordError, match=r"label 7, expected an integer in \[0, 2\)"):
            ds.read(3)


# ---- a broken first file must not decide the schema (issue 19, item 1) ------------------------------

def _broken_files() -> dict[str, bytes]:
    """Non-images a real class folder can hold, named to sort before the good files."""
    good = _jpeg(7)
    return {"0-empty.JPEG": b"", "1-text.jpg": b"not an image, just text\n", "2-random.jpg": bytes(range(256)) * 4,
            "3-magic-only.jpg": good[:3], "4-truncated-header.jpg": good[:40]}


def test_a_folder_whose_first_file_is_empty_still_checks_every_image(tmp_path):
    src = tmp_path / "train" / "cls"
    src.mkdir(parents=True)
    for name, data in _broken_files().items():
        (src / name).write_bytes(data)
    for i in range(3):
        (src / f"9-good-{i}.jpg").write_bytes(_jpeg(i))
    out = tmp_path / "ds.lmdb"
    run = stoker_cli("lmdb", "build", str(tmp_path / "train"), str(out), "--quiet")
    assert run.returncode == 0, run.stderr
    report_lines = run.stdout.splitlines()
    for name in _broken_files():
        assert sum(name in line and "skipped" in line for line in report_lines) == 1, (name, run.stdout)
    assert "fields: image (image), label (int) (declared by the build)" in run.stdout
    assert "must be non-empty bytes, got bytes" not in run.stdout and "is empty (0 bytes)" in run.stdout
    with LmdbDataset(out) as ds:
        assert ds.meta.fields["image"].kind == "image" and len(ds) == 3
        for i in range(len(ds)):
            assert ds.read(i)["image"] == _jpeg(i)  # every stored record reads back


def test_write_lmdb_infers_the_schema_from_the_first_record_that_passes_and_says_which(tmp_path):
    from stoker.producer.dataset.build.write_records import write_lmdb

    records = [{"image": b"", "label": 0}, {"image": _jpeg(1)[:3], "label": 1},
               {"image": _jpeg(2), "label": 2}, {"image": b"plain text", "label": 3}, {"image": _jpeg(4), "label": 4}]
    report = write_lmdb(tmp_path / "w.lmdb", records, progress=False)
    assert report.schema_from == "record 2" and report.meta.fields["image"].kind == "image"
    assert [p for p, _ in report.skipped] == ["record 0", "record 1", "record 3"]
    assert "is empty (0 bytes)" in report.skipped[0][1]
    with LmdbDataset(tmp_path / "w.lmdb") as ds:
        assert [ds.read(i)["label"] for i in range(len(ds))] == [2, 4]


def test_write_lmdb_warns_when_a_field_inferred_as_bytes_later_holds_images(tmp_path):
    from stoker.producer.dataset.build.write_records import write_lmdb

    records = [{"image": b"a text file named .jpg", "label": 0}, {"image": _jpeg(1), "label": 1}]
    report = write_lmdb(tmp_path / "w.lmdb", records, progress=False)
    assert report.schema_from == "record 0" and report.meta.fields["image"].kind == "bytes"
    assert len(report.warnings) == 1 and "declare it" in report.warnings[0] and "1 later record" in report.warnings[0]
    declared = write_lmdb(tmp_path / "d.lmdb", records, schema={"image": "image", "label": "int"}, progress=False)
    assert declared.schema_from == "declared" and [p for p, _ in declared.skipped] == ["record 0"]


def test_a_jsonl_build_takes_its_image_fields_as_images_whatever_comes_first(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_bytes(b"hello")
    (tmp_path / "good.jpg").write_bytes(_jpeg(3))
    lines = [{"image": "empty.jpg", "boxes": [[0, 0, 1, 1]]}, {"image": "text.jpg", "boxes": [[0, 0, 2, 2]]},
             {"image": "good.jpg", "boxes": [[1, 1, 3, 3]]}]
    src = tmp_path / "ann.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = build_lmdb(src, tmp_path / "j.lmdb", jsonl=True, progress=False)
    assert report.meta.fields["image"].kind == "image" and report.meta.count == 1
    assert [p.rsplit(":", 1)[1] for p, _ in report.skipped] == ["1", "2"]
