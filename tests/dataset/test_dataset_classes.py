"""Classes of a folder build (issue 31, items 5 and 10): empty class folders, per-class counts, skipped files once.

Real image folders, real LMDBs and the real ``stoker`` command, on a pseudo-terminal where the
behaviour is terminal-only.
"""

from __future__ import annotations

import functools
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import msgpack
import pytest

from stoker.producer.dataset.build.builder import SourceError, build_lmdb
from stoker.producer.dataset.sources import DatasetError, LmdbDataset
from stoker.producer.dataset.sources.lmdb_format import META_KEY
from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import stoker_cli, random_jpeg


_jpeg = functools.partial(random_jpeg, shape=(30, 40, 3))


def _stoker_on_a_terminal(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run ``stoker ARGS`` with stdout and stderr on a pseudo-terminal, as a user at a shell sees it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "stoker.cli.main", *args], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal's other end has closed it
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        proc.kill() if proc.poll() is None else None
    return proc.wait(timeout=10), b"".join(chunks).decode(errors="replace")


@pytest.fixture
def folder_with_an_empty_class(tmp_path: Path) -> Path:
    """cat 2, dog 3 (one in a nested sub-folder), ship 2, and an empty folder ``empty_class``."""
    src = tmp_path / "train"
    for cls, n in (("cat", 2), ("dog", 2), ("ship", 2)):
        (src / cls).mkdir(parents=True)
        for i in range(n):
            (src / cls / f"{i}.jpg").write_bytes(_jpeg(i))
    (src / "dog" / "more" / "deeper").mkdir(parents=True)
    (src / "dog" / "more" / "deeper" / "n.jpg").write_bytes(_jpeg(9))
    (src / "empty_class").mkdir()
    return src


def test_an_empty_class_folder_is_refused_naming_it_and_saying_how_to_fix_it(folder_with_an_empty_class, tmp_path):
    out = tmp_path / "out.lmdb"
    run = stoker_cli("lmdb", "build", str(folder_with_an_empty_class), str(out), "--quiet")
    assert run.returncode == 2, run.stdout
    assert str(folder_with_an_empty_class / "empty_class") + " (no files)" in run.stderr
    assert "Remove the folder" in run.stderr and "--allow-empty-classes" in run.stderr
    assert not out.exists() and not list(tmp_path.glob("out.lmdb.partial-*"))


def test_a_class_folder_whose_every_file_is_skipped_is_refused_naming_its_files(folder_with_an_empty_class, tmp_path):
    stray = folder_with_an_empty_class / "empty_class"
    (stray / "notes.jpg").write_text("a text file named .jpg")
    (stray / "README").write_text("where these came from")
    with pytest.raises(SourceError) as refused:
        build_lmdb(folder_with_an_empty_class, tmp_path / "out.lmdb", progress=False)
    message = str(refused.value)
    assert f"{stray} (2 file(s), none stored: README: the 21 image bytes are not a JPEG" in message
    assert "notes.jpg: the 22 image bytes are not a JPEG" in message and "allow_empty_classes=True" in message
    assert not (tmp_path / "out.lmdb").exists() and not list(tmp_path.glob("out.lmdb.partial-*"))


def test_allow_empty_classes_keeps_the_folder_as_a_class_with_0_records_and_warns(folder_with_an_empty_class, tmp_path):
    out = tmp_path / "out.lmdb"
    run = stoker_cli("lmdb", "build", str(folder_with_an_empty_class), str(out), "--quiet", "--allow-empty-classes")
    assert run.returncode == 0, run.stderr
    assert "warning: class 'empty_class' has 0 records, kept as label 2 (--allow-empty-classes)" in run.stdout
    assert "\n  empty_class  0\n" in run.stdout
    with LmdbDataset(out) as ds:
        assert ds.meta.classes == ("cat", "dog", "empty_class", "ship") and ds.meta.class_counts == (2, 3, 0, 2)


def test_build_and_info_print_the_records_of_every_class_nested_folders_included(folder_with_an_empty_class, tmp_path):
    (folder_with_an_empty_class / "empty_class").rmdir()
    out = tmp_path / "out.lmdb"
    build = stoker_cli("lmdb", "build", str(folder_with_an_empty_class), str(out), "--quiet")
    assert build.returncode == 0, build.stderr
    per_class = "records per class:\n  cat   2\n  dog   3\n  ship  2\n"
    assert per_class in build.stdout  # dog/more/deeper/n.jpg is a dog
    info = stoker_cli("lmdb", "info", str(out))
    assert info.returncode == 0, info.stderr
    assert per_class in info.stdout


def test_build_summarises_many_classes_and_leaves_the_full_list_to_info(tmp_path):
    src = tmp_path / "train"
    for c in range(25):
        (src / f"c{c:02d}").mkdir(parents=True)
        for i in range(1 + (c == 7) + 2 * (c == 11)):
            (src / f"c{c:02d}" / f"{i}.jpg").write_bytes(_jpeg(c * 10 + i))
    out = tmp_path / "out.lmdb"
    build = stoker_cli("lmdb", "build", str(src), str(out), "--quiet")
    assert f"records per class: min 1 (c00), median 1, max 3 (c11); `stoker lmdb info {out}` lists every class" \
        in build.stdout
    info = stoker_cli("lmdb", "info", str(out))
    assert "\n  c07  2\n" in info.stdout and "\n  c24  1\n" in info.stdout


def _dataset_without_class_counts(path: Path, labels: list[int], classes: list[str]) -> None:
    """A version 2 LMDB as Stoker wrote it before per-class counts were stored."""
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, label in enumerate(labels):
            txn.put(b"%08d" % i, msgpack.packb({"image": _jpeg(i), "label": label}, use_bin_type=True))
        txn.put(META_KEY, msgpack.packb({"format": "stoker-lmdb", "version": 2, "count": len(labels),
                                         "fields": {"image": {"kind": "image"}, "label": {"kind": "int"}},
                                         "classes": classes, "task": "classification"}, use_bin_type=True))
    env.close()


def test_info_on_a_dataset_built_before_per_class_counts_says_unknown_and_counts_on_request(tmp_path):
    old = tmp_path / "old.lmdb"
    _dataset_without_class_counts(old, [0, 1, 1, 0, 1], ["a", "b", "c"])
    with LmdbDataset(old) as ds:
        assert ds.meta.class_counts is None and len(ds) == 5  # still read as before
    info = stoker_cli("lmdb", "info", str(old))
    assert info.returncode == 0, info.stderr
    assert "records per class: unknown (built before Stoker stored them" in info.stdout
    assert "--count-classes" in info.stdout
    counted = stoker_cli("lmdb", "info", str(old), "--count-classes")
    assert counted.returncode == 0, counted.stderr
    assert "records per class (counted now):\n  a  2\n  b  3\n  c  0\n" in counted.stdout


def test_every_classification_writer_stores_per_class_counts_and_bad_ones_are_refused(tmp_path):
    meta = build_synthetic(tmp_path / "synth", 10, num_classes=3, progress=False)
    assert meta.class_counts == (4, 3, 3)
    with LmdbDataset(tmp_path / "synth") as ds:
        assert ds.meta.class_counts == (4, 3, 3)
    detection = build_synthetic(tmp_path / "det", 4, num_classes=3, progress=False, task="detection")
    assert detection.class_counts is None  # no label per record: nothing to count
    bad = tmp_path / "bad.lmdb"
    _dataset_without_class_counts(bad, [0, 1], ["a", "b"])
    env = lmdb.open(str(bad), map_size=1 << 24)
    with env.begin(write=True) as txn:
        body = msgpack.unpackb(txn.get(META_KEY))
        txn.put(META_KEY, msgpack.packb({**body, "class_counts": [1, 5]}, use_bin_type=True))
    env.close()
    with pytest.raises(DatasetError, match="class_counts must be one count >= 0 per class, summing to 2"):
        LmdbDataset(bad)


def test_each_skipped_file_is_named_exactly_once_on_a_terminal(tmp_path):
    src = tmp_path / "train"
    (src / "cat").mkdir(parents=True)
    for i in range(3):
        (src / "cat" / f"{i}.jpg").write_bytes(_jpeg(i))
    (src / "cat" / "garbage.jpg").write_bytes(b"\xff\xd8\xff" + bytes(range(200)))
    (src / "cat" / "text.jpg").write_text("a text file named .jpg\n")
    (src / "README.txt").write_text("outside every class folder\n")
    code, screen = _stoker_on_a_terminal("lmdb", "build", str(src), str(tmp_path / "out.lmdb"))
    assert code == 0, screen
    for name in ("garbage.jpg", "text.jpg", "README.txt"):
        assert screen.count(name) == 1, (name, screen)
    assert "wrote 3 records in 1 classes" in screen and "skipped 3 files (listed above)" in screen


def test_build_help_says_nested_folders_belong_to_their_class_and_what_happens_to_empty_ones():
    run = stoker_cli("lmdb", "build", "--help")
    text = " ".join(run.stdout.split())
    assert "files in nested sub-folders of a class folder belong to that class" in text
    assert "--allow-empty-classes" in text and "class with 0 records" in text
    assert "records per class" in " ".join(stoker_cli("lmdb", "info", "--help").stdout.split())
