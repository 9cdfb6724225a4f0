"""TFRecord import (producer/dataset/build/tfrecord_import.py): files written by real TensorFlow, read without it, and the two
parsers (frames, tf.train.Example) fuzzed: they return or raise BadExample, never anything else, and stay linear."""

from __future__ import annotations

import io
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.producer.dataset.sources import open_dataset
from stoker.producer.dataset.build.tfrecord_import import BadExample, frames, masked_crc, parse_example

from image_samples import encode, pattern_image

tf = pytest.importorskip("tensorflow")


def _example(**features) -> bytes:
    def feature(value):
        if isinstance(value, bytes):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        if isinstance(value, float):
            return tf.train.Feature(float_list=tf.train.FloatList(value=[value, -2.5]))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value, -7, 2**62]))
    return tf.train.Example(features=tf.train.Features(
        feature={k.replace("__", "/"): feature(v) for k, v in features.items()})).SerializeToString()


def test_examples_tensorflow_serializes_parse_to_the_same_features():
    data = _example(image__encoded=b"\xff\xd8abc", image__class__label=3, score=0.5)
    assert parse_example(data) == {"image/encoded": [b"\xff\xd8abc"], "image/class/label": [3, -7, 2**62],
                                   "score": [0.5, -2.5]}
    assert parse_example(b"") == {}


def _write(path, examples) -> None:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for example in examples:
            writer.write(example)


def test_a_build_from_tfrecord_files_stores_every_good_example_and_names_every_other(tmp_path):
    folder = tmp_path / "records"
    folder.mkdir()
    images = [encode("jpeg", np.roll(pattern_image(40, 30 + i), i, axis=0)) for i in range(12)]
    _write(folder / "train-00000-of-00002", [_example(image__encoded=images[i], image__class__label=i % 3)
                                              for i in range(6)])
    bad = [_example(image__encoded=images[6], image__class__label=1), _example(image__encoded=images[7]),
           _example(image__encoded=b"not an image", image__class__label=2),
           _example(image__encoded=images[8], image__class__label=-4)]
    _write(folder / "train-00001-of-00002", bad + [_example(image__encoded=images[9], image__class__label=2)])
    raw = bytearray((folder / "train-00001-of-00002").read_bytes())
    raw[20] ^= 0xFF  # the first frame's bytes: its data CRC fails
    (folder / "train-00001-of-00002").write_bytes(bytes(raw) + b"\x01\x02")  # and a truncated frame at the end
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "lmdb", "build", str(folder), str(tmp_path / "ds"),
                          "--from", "tfrecord", "--quiet", "--shard-size", "20KB"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = out.stdout + out.stderr
    for why in ("fail their CRC", "no int64 feature 'image/class/label'", "outside 0-", "truncated",
                "train-00001-of-00002#0", "train-00001-of-00002#5"):
        assert why in report, (why, report)
    assert "not an image" in report or "train-00001-of-00002#2" in report
    with open_dataset(tmp_path / "ds") as ds:
        stored = sorted((bytes(ds.read(i)["image"]), ds.read(i)["label"]) for i in range(len(ds)))
    assert stored == sorted([(images[i], i % 3) for i in range(6)] + [(images[9], 2)])


def test_frames_check_lengths_before_reading_and_stop_where_nothing_can_be_framed():
    good = b"hello"
    frame = struct.pack("<Q", 5) + struct.pack("<I", masked_crc(struct.pack("<Q", 5))) + good + \
        struct.pack("<I", masked_crc(good))
    assert [(d, w) for _, d, w in frames("f", io.BytesIO(frame * 2))] == [(good, ""), (good, "")]
    huge = struct.pack("<Q", 2**40)
    hostile = huge + struct.pack("<I", masked_crc(huge))
    (_, data, why), = frames("f", io.BytesIO(hostile + b"x" * 100))
    assert data is None and "more than" in why  # refused before any read of 2**40 bytes
    (_, data, why), = frames("f", io.BytesIO(b"\x00" * 12))
    assert data is None and "length fails its CRC" in why


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_an_example_or_a_named_refusal(data):
    try:
        features = parse_example(data)
    except BadExample:
        return
    assert isinstance(features, dict)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 300))
def test_mutated_examples_are_parsed_or_refused_never_crash(noise, at):
    data = bytearray(_example(image__encoded=b"\xff\xd8" + noise, image__class__label=5, score=1.5))
    data[at % len(data)] ^= (at % 255) + 1
    try:
        parse_example(bytes(data))
    except BadExample:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=256))
def test_random_files_frame_or_stop_with_a_reason(data):
    for _, payload, why in frames("f", io.BytesIO(data)):
        assert (payload is None) == bool(why)


def test_a_build_decodes_the_first_value_of_its_two_features_only_and_features_are_bounded():
    huge = tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"\xff\xd8", b"second"])),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[4] + [1] * 100_000)),
        "junk": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(100_000))))})).SerializeToString()
    assert parse_example(huge, {"image/encoded", "image/class/label"}, limit=1) == {
        "image/encoded": [b"\xff\xd8"], "image/class/label": [4], "junk": []}  # junk framed, never decoded
    many = _example(**{f"f{i}": i for i in range(2000)})
    assert len(parse_example(many)) == 2000
    with pytest.raises(BadExample, match="more than 4096"):
        parse_example(_example(**{f"f{i}": i for i in range(4097)}))


def test_a_tar_extended_header_claiming_gigabytes_is_refused_before_it_is_read():
    """tarfile reads a GNU long name or a pax header whole: WebDataset import bounds it first (webdataset_import.py)."""
    import tarfile

    from stoker.producer.dataset.build.webdataset_import import tar_items

    class Endless:
        """The header, then as many bytes as asked for: a tar whose header is the truth, up to 64 MiB read."""

        def __init__(self, head: bytes) -> None:
            self.head, self.served = head, 0

        def read(self, n=-1):
            assert 0 <= n and self.served + n < 64 << 20, "tarfile read the claimed header into memory"
            out = (self.head[self.served:self.served + n] + b"a" * n)[:n]
            self.served += n
            return out

    for kind in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME):
        header = tarfile.TarInfo("././@LongLink")
        header.type, header.size = kind, 2**32
        stream = Endless(header.tobuf(tarfile.GNU_FORMAT))
        (position, load), = list(tar_items("t.tar", stream))
        with pytest.raises(ValueError, match="extended header of 4294967296 bytes"):
            load()
