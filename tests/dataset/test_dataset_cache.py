"""Several processes building the same dataset at once: nothing clobbered, built once, nothing left behind."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stoker.producer.dataset.sources import DatasetError, LmdbDataset
from stoker.producer.dataset.build.lmdb_writer import DatasetWriter
from stoker.producer.dataset.build.partial_folders import remove_abandoned_partials
from stoker.producer.dataset.build.synthetic import synthetic_jpeg

pytestmark = pytest.mark.timeout(240)


def test_two_writers_of_one_dataset_never_clobber_each_other(tmp_path):
    out = tmp_path / "ds"
    first, second = DatasetWriter(out), DatasetWriter(out)
    assert first.partial != second.partial
    first.add({"image": synthetic_jpeg(0, 0, 2)[0], "label": 0})
    second.add({"image": synthetic_jpeg(0, 1, 2)[0], "label": 1})
    first.finish(["a", "b"])
    with pytest.raises(DatasetError, match="published by another process while this build ran"):
        second.finish(["a", "b"])
    with LmdbDataset(out) as ds:
        assert len(ds) == 1 and ds.read(0) == {"image": synthetic_jpeg(0, 0, 2)[0], "label": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_a_build_removes_abandoned_partials_but_never_one_being_written(tmp_path):
    out = tmp_path / "ds"
    alive = DatasetWriter(out)  # holds its lock, as a running build does
    abandoned = tmp_path / "ds.partial-dead0001"
    abandoned.mkdir()
    (abandoned / "building.lock").write_text("")  # its builder died: nobody holds the lock
    (tmp_path / "ds.partial").mkdir()  # left by a release before per-build partials
    removed = remove_abandoned_partials(out)
    assert sorted(p.name for p in removed) == ["ds.partial", "ds.partial-dead0001"]
    assert alive.partial.is_dir()
    alive.add({"image": synthetic_jpeg(0, 0, 2)[0], "label": 0})
    alive.finish(["a", "b"])
    assert len(LmdbDataset(out)) == 1


def test_a_second_demo_waits_for_the_first_to_build_the_cache_then_uses_it(tmp_path, monkeypatch):
    """The second process starts while the first is half-way through writing the dataset."""
    import stoker.producer.dataset.build.synthetic as synthetic
    from stoker.cli.demo import demo_dataset

    cache, records, lines, second = tmp_path / "cache", 16, queue.Queue(), []
    real_synthetic_jpeg = synthetic.synthetic_jpeg

    def reader(proc):
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def synthetic_jpeg_starting_a_second_demo(seed, index, num_classes):
        if index == records // 2:
            code = "import sys; from pathlib import Path; from stoker.cli.demo import demo_dataset; " \
                   "demo_dataset(Path(sys.argv[1]), int(sys.argv[2]))"
            proc = subprocess.Popen([sys.executable, "-c", code, str(cache), str(records)], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            second.append((proc, []))
            threading.Thread(target=reader, args=(proc,), daemon=True).start()
            deadline = time.monotonic() + 120
            while True:  # until it waits for us, or has finished (clobbering our half-written build)
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                if line is None or "waiting for" in line:
                    second[0][1].append(line or "")
                    break
                second[0][1].append(line)
        return real_synthetic_jpeg(seed, index, num_classes)

    monkeypatch.setattr(synthetic, "synthetic_jpeg", synthetic_jpeg_starting_a_second_demo)
    path = demo_dataset(cache, records)
    proc, output = second[0]
    assert proc.wait(120) == 0
    while (line := lines.get(timeout=10)) is not None:
        output.append(line)
    text = "".join(output)
    assert "waiting for process" in text and "building synthetic dataset" not in text, text
    with LmdbDataset(path) as ds:
        assert len(ds) == records
    assert sorted(p.name for p in cache.iterdir()) == [".demo-lmdb-16.lock", "demo-lmdb-16"]
