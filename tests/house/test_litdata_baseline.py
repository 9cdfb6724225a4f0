"""benchmarks/litdata_baseline.py without LitData: the parts that run in Stoker's venv (the CLI's help, the driver's
errors) and the parts whose claims the figures rest on (the tars' samples as the other sources serve them, the
caption padded as ``utf8_into`` pads it). LitData itself lives in a venv of its own and is not installed here."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import ROOT, benchmark_module

from stoker.producer.images.image_text import utf8_into

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def baseline():
    return benchmark_module("litdata_baseline")


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_its_help_runs_in_stokers_venv_and_names_both_commands():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "litdata_baseline.py"), "--help"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "convert" in done.stdout and "read" in done.stdout


def test_a_tars_samples_are_its_jpg_and_txt_members_grouped_by_key(baseline, tmp_path):
    _tar(tmp_path / "000000.tar", [("000000001.jpg", b"J1"), ("000000001.txt", b"one"), ("000000001.json", b"{}"),
                                   ("000000002.jpg", b"J2"), ("000000002.json", b"{}"),
                                   ("000000002.txt", "twé".encode()), ("000000003.jpg", b"J3"),
                                   ("000000003.txt", b"three")])
    assert list(baseline.tar_samples(str(tmp_path / "000000.tar"))) == [
        {"jpg": b"J1", "txt": "one"}, {"jpg": b"J2", "txt": "twé"}, {"jpg": b"J3", "txt": "three"}]


@pytest.mark.parametrize("caption", ["a short one", "x" * 76 + "é and on", "é" * 50])
def test_the_job_pads_a_caption_as_utf8_into_does_and_crops_to_the_image_size(baseline, caption):
    ok, jpeg = cv2.imencode(".jpg", np.full((40, 60, 3), 128, np.uint8))
    assert ok
    image, text, length = baseline.ImageTextJob(16)({"jpg": jpeg.tobytes(), "txt": caption})
    expected = np.empty(baseline.TEXT_LENGTH, np.uint8)
    assert length == utf8_into(caption, expected, False, "txt")
    assert text.tobytes() == expected.tobytes()
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8


def test_a_python_without_litdata_fails_with_the_command_named(baseline, tmp_path):
    with pytest.raises(RuntimeError, match="litdata_baseline.py convert"):
        baseline.convert_with(sys.executable, tmp_path, tmp_path / "out", 4, 1)
