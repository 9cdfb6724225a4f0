"""The dataset a producer serves is named on every batch it sends (header field ``source``, issue 42), and a
trainer names it back: real producers over an index of real tars, read raw off a socket and by a BatchStream whose
stats and metrics name them; the label keeps to the header's rule and never shows a credential; the trainer keeps
the latest of a bounded number of producers."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.producer.dataset.build.webdataset_index import index_webdataset, write_index
from stoker.producer.dataset.sources.record_source import shown_location, source_label
from stoker.producer.process import ProducerProcess
from stoker.protocol import decode_batch
from stoker.protocol.batch_header import MAX_SOURCE_CHARS, source_ok

from conftest import random_jpeg

pytestmark = pytest.mark.timeout(120)


def write_tar_index(folder: Path, tars: int = 2, samples: int = 6) -> Path:
    """``tars`` img2dataset-style tars (KEY.jpg, KEY.txt, KEY.cls) in ``folder``/wds and their index, returned."""
    (folder / "wds").mkdir()
    for number in range(tars):
        with tarfile.open(folder / "wds" / f"{number:06d}.tar", "w") as tar:
            for i in range(number * samples, (number + 1) * samples):
                for ext, data in (("jpg", random_jpeg(i, (24, 24, 3))), ("txt", f"photo {i}".encode()),
                                  ("cls", str(i % 3).encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    index = folder / "tars.json"
    write_index(index_webdataset([str(p) for p in sorted((folder / "wds").glob("*.tar"))], progress=False), str(index))
    return index


def tar_producer(index: Path, *flags: str) -> ProducerProcess:
    """A one-worker producer of image-text batches of 4 over the tars of ``index``, not yet started."""
    return ProducerProcess(index, extra_args=["--pipeline", "image_text", "--mode", "eval", "--workers", "1",
                                              "--batch-size", "4", "--image-size", "16", *flags])


@pytest.fixture(scope="module")
def tar_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tar_index(tmp_path_factory.mktemp("named"))


def test_every_batch_of_a_producer_over_tars_names_them(tar_index: Path):
    index = tar_index
    with tar_producer(index) as producer:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        try:
            sock.connect(producer.endpoint)
            sources = set()
            for _ in range(3):
                assert sock.poll(30000), "no batch from the producer in 30 s"
                sources.add(decode_batch(sock.recv_multipart()).header.source)
        finally:
            sock.close(0)
            ctx.term()
    assert sources == {f"webdataset {index}"}


def test_a_trainer_names_the_tars_its_producers_serve_in_its_stats_and_metrics(tar_index: Path):
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from stoker.consumer import BatchStream
    from stoker.consumer.receive.metrics import InputCollector
    from stoker.consumer.train.run_summary import served_sources

    with tar_producer(tar_index) as first, tar_producer(tar_index) as second, \
            BatchStream([first.endpoint, second.endpoint], recv_timeout=30) as stream:
        while len(stream.stats.per_producer) < 2:  # a batch from each: each named its source
            next(stream)
        registry = CollectorRegistry()
        registry.register(InputCollector(stream))
        scraped = {tuple(sorted(s.labels.items())): s.value for family in
                   text_string_to_metric_families(generate_latest(registry).decode())
                   for s in family.samples if s.name == "stoker_trainer_producer_source_info"}
        stats = stream.stats
    source = f"webdataset {tar_index}"
    assert stats.producer_sources == {first.producer_id: source, second.producer_id: source}
    assert scraped == {(("producer", p), ("source", source)): 1.0 for p in (first.producer_id, second.producer_id)}
    assert served_sources(stats) == (f"{source} (2 producers)", "")


@pytest.mark.parametrize("location, shown", [
    ("/data/laion/index.json", "/data/laion/index.json"),
    ("s3://b/laion/index.json", "s3://b/laion/index.json"),
    ("https://user:s3cret@host:9000/laion/index.json?X-Amz-Signature=abc#x", "https://host:9000/laion/index.json"),
    ("s3://key:s3cret@b/{000..009}.tar", "s3://b/{000..009}.tar"),
    ("http://[::1/s3cret", "http://(unparsable URL)"),
])
def test_a_location_is_shown_without_credentials_or_signed_queries(location, shown):
    assert shown_location(location) == shown
    assert source_label("webdataset", location) == f"webdataset {shown}"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["lmdb", "webdataset", "parquet"]),
       st.one_of(st.text(max_size=400), st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=200,
                                                max_size=400)))
def test_any_location_makes_a_label_a_receiver_accepts(kind, location):
    label = source_label(kind, location)
    assert source_ok(label) and label.startswith(f"{kind} ")
    plain = "://" not in location and location.isascii() and location.isprintable()
    assert not plain or label == f"{kind} {location}"[:MAX_SOURCE_CHARS - 130] + label[MAX_SOURCE_CHARS - 130:]
    if plain and len(f"{kind} {location}") > MAX_SOURCE_CHARS:  # cut in the middle: the file it ends in is kept
        assert label.endswith(location[-120:]) and "..." in label
    tail = location.replace("/", "").replace("s3cret", "")
    assert "s3cret" not in source_label(kind, f"s3://k:s3cret@b/{tail}")


def test_a_trainer_keeps_the_latest_source_of_at_most_so_many_producers():
    from stoker.consumer.receive import stats as receive_stats
    from stoker.protocol import encode_batch

    def batch(producer: str, source: str):
        return decode_batch(encode_batch({"x": np.zeros(2, np.uint8)}, producer=producer, seq=0, source=source))

    counted = receive_stats.ReceiveStats()
    bound = receive_stats.MAX_SOURCE_PRODUCERS
    for i in range(bound + 2):
        b = batch(f"p{i}", f"lmdb /d/{i}")
        counted.accepted(b, list(b.arrays.values()))
    older = batch("p0", "")  # a producer that names nothing keeps what it named before, here nothing
    counted.accepted(older, list(older.arrays.values()))
    moved = batch("p5", "parquet /d/moved")  # the latest named wins, and is kept the longest
    counted.accepted(moved, list(moved.arrays.values()))
    sources = counted.snapshot().producer_sources
    assert len(sources) == bound and "p0" not in sources and "p1" not in sources
    assert sources["p5"] == "parquet /d/moved" and list(sources)[-1] == "p5"
    assert sources[f"p{bound + 1}"] == f"lmdb /d/{bound + 1}"
