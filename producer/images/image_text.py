"""The built-in ``image_text`` pipeline (``stoker produce --pipeline image_text``): an image and its caption, for
CLIP-style contrastive training.

The image goes through the imagenet pipeline's own step (``builtin_pipelines.ImagenetImage``): train:
random-resized-crop (``scale``, ``ratio``, decoding only the crop window of a JPEG) and a horizontal flip; eval:
resize and centre crop (``eval_crop``).

The caption is a ``str`` record field (``text_field``, default ``text``: a WebDataset ``.txt`` member, a Parquet
string column, an LMDB ``str`` field) and travels as a variable-length field of at most ``text_length`` entries
(the wire's ``upto(N)``: padded to N, with an int32 ``texts_len`` array of each row's true length):

- by default its UTF-8 bytes, ``texts uint8 [N]`` (zeros after ``texts_len``; ``bytes(row[:n]).decode()``
  gives the caption back);
- with ``tokenizer`` (``package.module:name`` or ``path/file.py:name``, found as ``--pipeline`` is, or a callable
  from Python): the token ids it returns, ``texts int32 [N]`` padded with ``pad_id``. The tokenizer is called
  with the caption and returns a sequence of integer ids (a list, a 1-D array, or a mapping holding
  ``input_ids``, as a Hugging Face tokenizer's ``__call__`` does).

A caption longer than N is cut to its first N bytes (never inside a UTF-8 character, so ``texts_len`` may be a
little under N) or its first N ids: CLIP's own recipe, silent and not counted. ``long_text=skip`` makes such a
record a SampleError instead, skipped and counted by the producer like any bad sample. A missing or non-str
caption, or a tokenizer that raises or returns anything but ids that fit int32, is a SampleError naming the field.

With ``label_field`` set, the record's integer class also travels as ``labels int32`` (a record without one is
a SampleError); by default no labels are declared.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Union

import numpy as np

from stoker.producer.images.augment import CROP_DECODING, EVAL_CROP_FRACTION, RATIO, SCALE
from stoker.producer.images.builtin_pipelines import ImagenetImage, Pair, class_label, encoded_image
from stoker.producer.pipeline import Field, Pipeline, PipelineError, SampleError, upto
from stoker.producer.pipeline.loading import import_reference

#: CLIP's context length, in tokens; as bytes it holds a short English caption.
TEXT_LENGTH = 77
#: What can be asked of text_length: a row is 4 bytes an id, and a caption is a caption, not a document.
MAX_TEXT_LENGTH = 65536
_INT32 = np.iinfo(np.int32)

Tokenizer = Callable[[str], Any]


def caption(record: Mapping[str, Any], field: str) -> str:
    """The caption ``field`` of ``record``; SampleError naming the field when it is missing or not text."""
    text = record.get(field)
    if isinstance(text, str):
        return text
    if text is None:
        names = sorted(record)
        listed = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        raise SampleError(f"record field {field!r} is missing (the record has {listed or 'no fields'}): "
                          "name the caption's field with --pipeline-arg text_field=NAME")
    raise SampleError(f"record field {field!r} is {type(text).__name__}, expected a str caption")


def utf8_into(text: str, row: np.ndarray, skip_long: bool, field: str) -> int:
    """Write ``text``'s UTF-8 bytes into the uint8 ``row``, zeros after; the bytes kept (a long one cut before a
    whole character, or SampleError with ``skip_long``)."""
    data = text.encode("utf-8", "replace")  # a lone surrogate (a lenient decoder's) becomes "?": rows stay UTF-8
    n = len(data)
    if n > len(row):
        if skip_long:
            raise SampleError(f"record field {field!r} is {n} bytes of UTF-8, more than text_length={len(row)} "
                              "(raise it, or --pipeline-arg long_text=cut)")
        n = len(row)
        while n and data[n] & 0xC0 == 0x80:  # a continuation byte: the cut would split a character
            n -= 1
    row[:n] = np.frombuffer(data, np.uint8, n)
    row[n:] = 0
    return n


def token_ids(tokenizer: Tokenizer, text: str, field: str) -> np.ndarray:
    """The 1-D int32 ids ``tokenizer`` makes of ``text``; SampleError if it raises or returns anything else."""
    try:
        made = tokenizer(text)
    except Exception as exc:
        raise SampleError(f"record field {field!r}: the tokenizer raised {type(exc).__name__}: {exc}") from exc
    if isinstance(made, Mapping) and "input_ids" in made:  # a Hugging Face tokenizer's BatchEncoding
        made = made["input_ids"]
    try:
        ids = np.asarray(made)
    except Exception as exc:
        raise SampleError(f"record field {field!r}: the tokenizer returned {type(made).__name__}, not ids "
                          f"({exc})") from None
    if ids.size == 0:
        return np.zeros(0, np.int32)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise SampleError(f"record field {field!r}: the tokenizer returned {ids.dtype} {list(ids.shape)}; it must "
                          "return one sequence of integer ids per caption")
    if ids.min() < _INT32.min or ids.max() > _INT32.max:
        raise SampleError(f"record field {field!r}: the tokenizer returned ids beyond int32 "
                          f"({int(ids.min())}..{int(ids.max())})")
    return ids.astype(np.int32, copy=False)


def ids_into(ids: np.ndarray, row: np.ndarray, pad_id: int, skip_long: bool, field: str) -> int:
    """Write ``ids`` into the int32 ``row``, ``pad_id`` after; the ids kept (cut to the row, or SampleError)."""
    if len(ids) > len(row) and skip_long:
        raise SampleError(f"record field {field!r} is {len(ids)} tokens, more than text_length={len(row)} "
                          "(raise it, or --pipeline-arg long_text=cut)")
    n = min(len(ids), len(row))
    row[:n] = ids[:n]
    row[n:] = pad_id
    return n


def _tokenizer(tokenizer: Union[str, Tokenizer, None]) -> Tokenizer | None:
    if tokenizer in ("", None):
        return None
    found = import_reference(tokenizer, "--pipeline-arg tokenizer") if isinstance(tokenizer, str) else tokenizer
    if not callable(found):
        raise PipelineError(f"--pipeline-arg tokenizer={tokenizer}: a {type(found).__name__}, not a function "
                            "from a caption to token ids")
    return found


def make_image_text(mode: str = "train", image_size: int = 224, size: str = "", scale: Pair = SCALE,
                    ratio: Pair = RATIO, flip: bool = True, eval_crop: float = EVAL_CROP_FRACTION,
                    fast_dct: bool = False, crop_decoding: bool = CROP_DECODING, image_field: str = "image",
                    text_field: str = "text", text_length: int = TEXT_LENGTH,
                    tokenizer: Union[str, Tokenizer, None] = "", pad_id: int = 0, long_text: str = "cut",
                    label_field: str = "") -> Pipeline:
    """Image and caption: ``images uint8 [H, W, 3]``, ``texts uint8 [<=text_length]`` (UTF-8 bytes) or ``int32``
    (``tokenizer``'s ids, padded with ``pad_id``) with ``texts_len``, and ``labels int32`` with ``label_field``.

    PipelineError for a bad argument or a tokenizer that cannot be imported (see the module doc).
    """
    image = ImagenetImage(mode, image_size, size, scale, ratio, flip, eval_crop, fast_dct, crop_decoding,
                          image_field)
    if not 1 <= text_length <= MAX_TEXT_LENGTH:
        raise PipelineError(f"text_length {text_length}: must be 1 to {MAX_TEXT_LENGTH}")
    if long_text not in ("cut", "skip"):
        raise PipelineError(f"long_text {long_text!r}: cut (keep the first text_length) or skip (skip the record)")
    tokenize = _tokenizer(tokenizer)
    if tokenize is None and pad_id != 0:
        raise PipelineError(f"pad_id {pad_id}: UTF-8 bytes are padded with zeros; pad_id is for a tokenizer's ids")
    if not _INT32.min <= pad_id <= _INT32.max:
        raise PipelineError(f"pad_id {pad_id}: must fit int32")
    skip_long = long_text == "skip"

    def fill(record: Mapping[str, Any], rng: np.random.Generator, rows: dict[str, np.ndarray]) -> dict[str, int]:
        data = encoded_image(record, image_field)
        text = caption(record, text_field)
        if label_field:
            rows["labels"][...] = class_label(record, label_field)
        if tokenize is None:
            length = utf8_into(text, rows["texts"], skip_long, text_field)
        else:
            length = ids_into(token_ids(tokenize, text, text_field), rows["texts"], pad_id, skip_long, text_field)
        image.into(data, rng, rows["images"])
        return {"texts": length}

    fields = [image.field,
              Field("texts", "uint8" if tokenize is None else "int32", (upto(text_length),))]
    if label_field:
        fields.append(Field("labels", "int32", ()))
    return Pipeline(fields, fill=fill, name="image_text", stage_times=image.stage_times)
