"""The built-in image_text pipeline: captions as UTF-8 bytes or token ids, on its own and through real producers to
each facade (BatchStream in exact mode, TorchInput, ZMQInput)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stoker.consumer import BatchStream
from stoker.producer.dataset.build.write_records import write_lmdb
from stoker.producer.images.image_text import make_image_text, utf8_into
from stoker.producer.pipeline import PipelineError, SampleError, load_pipeline
from stoker.producer.serve.batch_slots import SlotLayout, sample_rows

from conftest import EVAL_SIZE as SIZE, expected_eval_image, one_worker_producer, random_jpeg

pytestmark = pytest.mark.timeout(180)

TOKENIZERS = Path(__file__).parents[1] / "pipelines" / "tokenizers.py"
LENGTH = 24  # text_length in these tests: the long captions below are cut
CAPTIONS = ["a red square", "", "un café crème", "狗在草地上跑", "emoji 🐕 and more", "x" * 40,
            "naïve " * 5, "a b c", "the quick brown fox jumps over the lazy dog", "é" * 30]
RECORDS = 20
BATCH = 4


def _record(i: int) -> dict:
    return {"image": random_jpeg(i, (36 + i, 44, 3)), "text": CAPTIONS[i % len(CAPTIONS)], "label": i % 3}


def _cut(text: str, limit: int = LENGTH) -> bytes:
    """The caption's bytes as the pipeline keeps them, written out independently: whole characters within limit."""
    kept = b""
    for char in text:
        if len(kept) + len(char.encode()) > limit:
            break
        kept += char.encode()
    return kept


@pytest.fixture(scope="module")
def captions_lmdb(tmp_path_factory) -> Path:
    """20 records of an image, a caption (str) and a label, some captions longer than LENGTH bytes."""
    path = tmp_path_factory.mktemp("captions") / "ds"
    write_lmdb(path, (_record(i) for i in range(RECORDS)), classes=["a", "b", "c"], progress=False)
    return path


def _rows(pipeline) -> dict[str, np.ndarray]:
    layout = SlotLayout(pipeline.batch_arrays(), 1, slots=1)
    return sample_rows(layout.views(bytearray(layout.slot_bytes))[0])[0]


# ---- the pipeline on its own -------------------------------------------------------------------------------

def test_captions_travel_as_their_utf8_bytes_cut_at_whole_characters_and_images_as_imagenet_eval():
    pipeline = make_image_text(mode="eval", image_size=SIZE, text_length=LENGTH, label_field="label")
    assert pipeline.batch_arrays() == (("images", "uint8", (SIZE, SIZE, 3)), ("texts", "uint8", (LENGTH,)),
                                       ("texts_len", "int32", ()), ("labels", "int32", ()), ("index", "int64", ()),
                                       ("epoch", "int32", ()))
    for i in range(len(CAPTIONS)):
        row, record = _rows(pipeline), _record(i)
        pipeline.write(record, np.random.default_rng(i), row)
        n = int(row["texts_len"])
        assert bytes(row["texts"][:n]) == _cut(record["text"]) and not row["texts"][n:].any()
        assert int(row["labels"]) == record["label"]
        assert np.array_equal(row["images"], expected_eval_image(record["image"]))


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40), st.integers(1, 30))
def test_kept_bytes_are_always_a_whole_character_prefix_of_the_caption(text, limit):
    row = np.full(limit, 255, np.uint8)
    n = utf8_into(text, row, skip_long=False, field="text")
    kept = bytes(row[:n]).decode("utf-8")  # raises if a character was split
    assert text.startswith(kept) and not row[n:].any()
    assert n == len(_cut(text, limit))


def test_a_lone_surrogate_from_a_lenient_decoder_travels_as_a_question_mark_so_rows_stay_utf8():
    row = np.zeros(8, np.uint8)
    assert bytes(row[:utf8_into("a\udc80b", row, skip_long=False, field="text")]) == b"a?b"


@pytest.mark.parametrize("record, message", [
    ({"image": b"\xff"}, "record field 'text' is missing .* text_field=NAME"),
    ({"image": b"\xff", "text": b"bytes, not str"}, "record field 'text' is bytes, expected a str caption"),
    ({"image": b"\xff", "text": 7}, "record field 'text' is int"),
])
def test_a_missing_or_non_text_caption_is_a_sample_error_naming_the_field(record, message):
    with pytest.raises(SampleError, match=message):
        make_image_text(mode="eval", image_size=SIZE).write(record, np.random.default_rng(0), {})


def test_long_text_skip_refuses_a_long_caption_so_the_producer_counts_it():
    pipeline = make_image_text(mode="eval", image_size=SIZE, text_length=LENGTH, long_text="skip")
    with pytest.raises(SampleError, match="40 bytes of UTF-8, more than text_length=24"):
        pipeline.write(_record(5), np.random.default_rng(0), _rows(pipeline))


@pytest.mark.parametrize("name", ["byte_ids", "hugging_face_style"])
def test_a_tokenizer_by_reference_gives_int32_ids_padded_with_pad_id(name):
    pipeline = load_pipeline("image_text", {"tokenizer": f"{TOKENIZERS}:{name}", "pad_id": "-1",
                                            "text_length": str(LENGTH)}, {"mode": "train", "image_size": SIZE})
    assert ("texts", "int32", (LENGTH,)) in pipeline.batch_arrays()
    row, record = _rows(pipeline), _record(2)
    pipeline.write(record, np.random.default_rng(0), row)
    n = int(row["texts_len"])
    assert bytes(int(t) - 1 for t in row["texts"][:n]) == record["text"].encode()[:LENGTH]
    assert set(row["texts"][n:].tolist()) <= {-1}


@pytest.mark.parametrize("tokenizer, message", [
    (lambda text: [[1, 2]], r"returned int64 \[1, 2\]; it must return one sequence"),
    (lambda text: ["a"], "returned <U1"),
    (lambda text: [2**40], "ids beyond int32"),
    (lambda text: 1 / 0, "the tokenizer raised ZeroDivisionError"),
])
def test_a_tokenizer_that_raises_or_returns_no_ids_costs_only_that_sample(tokenizer, message):
    pipeline = make_image_text(mode="eval", image_size=SIZE, tokenizer=tokenizer)
    with pytest.raises(SampleError, match=message):
        pipeline.write(_record(0), np.random.default_rng(0), _rows(pipeline))


@pytest.mark.parametrize("args, message", [
    ({"tokenizer": "no_such_tokenizer_module:tok"}, "tokenizer 'no_such_tokenizer_module:tok': cannot import"),
    ({"tokenizer": f"{TOKENIZERS}:missing"}, "has no 'missing'"),
    ({"tokenizer": "bare_name"}, "expected package.module:name"),
    ({"pad_id": "3"}, "pad_id is for a tokenizer's ids"),
    ({"text_length": "0"}, "text_length 0"),
    ({"long_text": "drop"}, "long_text 'drop'"),
])
def test_arguments_that_cannot_work_stop_the_pipeline_at_load_naming_the_fix(args, message):
    with pytest.raises(PipelineError, match=message):
        load_pipeline("image_text", args)


# ---- through real producers to each facade ----------------------------------------------------------------

def _producer(data: Path, *args: str):
    return one_worker_producer(data, "--pipeline", "image_text", "--pipeline-arg", f"text_length={LENGTH}", *args,
                               batch=BATCH, size=SIZE, flags=["--seed", "3"])


def test_batch_stream_in_exact_mode_gets_every_record_once_with_its_caption_label_and_image(captions_lmdb):
    seen: Counter = Counter()
    labelled = ("--epochs", "1", "--mode", "eval", "--pipeline-arg", "label_field=label")
    with _producer(captions_lmdb, *labelled) as producer, \
            BatchStream([producer.endpoint], exact=True, recv_timeout=60) as stream:
        for batch in stream:
            assert batch["texts"].dtype == np.uint8 and batch["texts"].shape[1:] == (LENGTH,)
            for row, index in enumerate(batch["index"].tolist()):
                record, n = _record(index), int(batch["texts_len"][row])
                assert bytes(batch["texts"][row, :n]).decode() == _cut(record["text"]).decode()
                assert int(batch["labels"][row]) == record["label"]
                assert np.array_equal(batch["images"][row], expected_eval_image(record["image"]))
                seen[index] += 1
    assert sorted(seen) == list(range(RECORDS)) and set(seen.values()) == {1}


def test_torch_input_gets_token_ids_from_the_users_tokenizer(captions_lmdb):
    if not os.environ.get("CI"):  # CI installs the extra (.ci/run): there a missing torch fails the run
        pytest.importorskip("torch", reason="the stoker[torch] extra is not installed (.ci/run installs it)")
    import torch

    from stoker.consumer import TorchInput

    tokenizer = f"tokenizer={TOKENIZERS}:byte_ids"
    with _producer(captions_lmdb, "--pipeline-arg", tokenizer, "--pipeline-arg", "pad_id=999") as producer, \
            TorchInput([producer.endpoint], recv_timeout=60) as inp:
        for _, batch in zip(range(6), inp):
            texts, lengths = batch["texts"], batch["texts_len"]
            assert texts.dtype == torch.int32 and texts.shape == (BATCH, LENGTH)
            assert batch["images"].shape == (BATCH, SIZE, SIZE, 3)
            for ids, n, index in zip(texts.tolist(), lengths.tolist(), batch["index"].tolist()):
                assert bytes(t - 1 for t in ids[:n]) == _record(index)["text"].encode()[:LENGTH]
                assert set(ids[n:]) <= {999}


def test_zmq_input_gets_captions_and_a_long_one_is_skipped_named_and_counted_with_long_text_skip(captions_lmdb):
    from stoker.consumer import ZMQInput

    long = {i for i in range(RECORDS) if len(_record(i)["text"].encode()) > LENGTH}
    seen: Counter = Counter()
    with _producer(captions_lmdb, "--pipeline-arg", "long_text=skip") as producer:
        with ZMQInput([producer.endpoint], recv_timeout=60) as inp:
            assert inp.spec.names == ("images", "texts", "texts_len", "index", "epoch")
            for _ in range(100):  # until epoch 0 is whole but for the long captions
                batch = {name: tensor.numpy() for name, tensor in inp.get().items()}
                for row, (index, epoch) in enumerate(zip(batch["index"].tolist(), batch["epoch"].tolist())):
                    text = bytes(batch["texts"][row, :batch["texts_len"][row]]).decode()
                    assert text == _record(index)["text"] and index not in long
                    if epoch == 0:
                        seen[index] += 1
                if set(seen) >= set(range(RECORDS)) - long:
                    break
        assert producer.stop() == 0
    assert set(seen) == set(range(RECORDS)) - long and long
    for index in long:
        assert f"skipping record {index:08d}: record field 'text' is" in producer.log_text()
    assert producer.counters()[2] >= len(long)
