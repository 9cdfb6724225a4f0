"""Records from TFRecord files of ``tf.train.Example``, for ``stoker lmdb build --from tfrecord``, without TensorFlow.

A TFRecord file is a run of frames: ``uint64 length``, ``uint32 masked CRC-32C of the length``, ``length`` bytes,
``uint32 masked CRC-32C of the bytes`` (little-endian). Each frame's bytes are a serialized ``tf.train.Example``:
a map from feature names to lists of bytes, floats or int64s. Each Example becomes a record
``{"image": <the image feature's bytes>, "label": <the label feature's int>}`` (``image/encoded`` and
``image/class/label`` unless named otherwise: the names TensorFlow's ImageNet and object-detection scripts write).

Both layers are parsers of untrusted bytes, written here and fuzzed (tests/dataset/test_tfrecord.py): no length is trusted
(a frame is at most ``MAX_RECORD_BYTES``, read only after its length's CRC matched; every protobuf length is checked
against what is left of its message), a varint is at most 10 bytes, an Example at most ``MAX_FEATURES`` features,
the work is linear in the bytes, and a build decodes only the first value of its two features (the rest is
framed, never decoded into Python objects). Nothing is lost silently: a frame whose bytes fail their CRC, an Example that
does not parse or lacks its image or label, a label outside 0-``MAX_LABEL``: each is a ``(position, reason)`` the
builder lists and counts (``FILE#N``, the frame's number), and the build goes on. A frame whose *length* fails its
CRC or a truncated file ends that file's reading (nothing after it can be framed), named the same way.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Collection, Iterator, Mapping, Optional, Sequence

from stoker.producer.dataset.sources.lmdb_format import MAX_RECORD_BYTES

MAX_FEATURES = 4096
MAX_LABEL = 10**6  # a larger class index is a corrupt label, not a dataset (the builder sizes classes by it)
IMAGE_KEY, LABEL_KEY = "image/encoded", "image/class/label"
_MASK_DELTA = 0xA282EAD8

Item = tuple[str, Callable[[], Mapping[str, Any]]]
Feature = list  # bytes, floats or ints


class BadExample(ValueError):
    """Bytes that are not a ``tf.train.Example`` (or a record the builder reports instead of storing)."""


def masked_crc(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant (mod 2**32)."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise BadExample("a varint runs past the end of its message")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if shift >= 70:
            raise BadExample("a varint is longer than 10 bytes")


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of each field of the message ``buf[start:end]``: an int for varints,
    ``(start, end)`` of the bytes for the others. BadExample for anything that does not frame."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, 0, value
            continue
        size = {1: 8, 5: 4}.get(wire)
        if wire == 2:
            size, pos = _varint(buf, pos, end)
        elif size is None:
            raise BadExample(f"field {number} has wire type {wire}, which tf.train.Example does not use")
        if size > end - pos:
            raise BadExample(f"field {number} says {size} bytes, more than its message holds")
        yield number, wire, (pos, pos + size)
        pos += size


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _feature(buf: bytes, start: int, end: int, limit: Optional[int] = None) -> Feature:
    """A ``tf.train.Feature``: its list of bytes (field 1), floats (2) or int64s (3), packed or not; at most the
    first ``limit`` values (None: all)."""
    values: Feature = []
    for kind, wire, span in _fields(buf, start, end):
        if limit is not None and len(values) >= limit:
            break
        if kind not in (1, 2, 3) or wire != 2:
            continue  # an unknown field: protobuf passes over it
        for number, item_wire, item in _fields(buf, *span):
            if number != 1:
                continue
            if kind == 1 and item_wire == 2:
                values.append(buf[item[0]:item[1]])
            elif kind == 2 and item_wire == 2 and (item[1] - item[0]) % 4 == 0:
                count = (item[1] - item[0]) // 4 if limit is None else min(limit, (item[1] - item[0]) // 4)
                values.extend(struct.unpack_from(f"<{count}f", buf, item[0]))
            elif kind == 2 and item_wire == 5:
                values.append(struct.unpack_from("<f", buf, item[0])[0])
            elif kind == 3 and item_wire == 2:
                pos = item[0]
                while pos < item[1] and (limit is None or len(values) < limit):
                    value, pos = _varint(buf, pos, item[1])
                    values.append(_signed(value))
            elif kind == 3 and item_wire == 0:
                values.append(_signed(item))
            else:
                raise BadExample(f"a feature's list holds a value of wire type {item_wire}")
            if limit is not None and len(values) >= limit:
                return values[:limit]
    return values


def parse_example(data: bytes, names: Optional[Collection[str]] = None, limit: Optional[int] = None
                  ) -> dict[str, Feature]:
    """The features of a serialized ``tf.train.Example``: name -> list of values. BadExample naming what is wrong.
    ``names``: decode only these features (others are framed, never decoded: a build reads two features of each
    Example, and an 8 MB list of int64s would cost seconds and hundreds of MB); ``limit``: at most so many
    values of each."""
    features: dict[str, Feature] = {}
    for number, wire, span in _fields(data, 0, len(data)):
        if number != 1 or wire != 2:
            continue
        for entry_number, entry_wire, entry in _fields(data, *span):  # Features: map<string, Feature> entries
            if entry_number != 1 or entry_wire != 2:
                continue
            name: Optional[str] = None
            value_span: Optional[tuple[int, int]] = None
            for part, part_wire, part_span in _fields(data, *entry):
                if part == 1 and part_wire == 2:
                    try:
                        name = data[part_span[0]:part_span[1]].decode("utf-8")
                    except UnicodeDecodeError:
                        raise BadExample("a feature's name is not UTF-8") from None
                elif part == 2 and part_wire == 2:
                    value_span = part_span
            if name is None:
                raise BadExample("a feature has no name")
            if names is None or name in names:
                features[name] = _feature(data, *value_span, limit=limit) if value_span is not None else []
            else:
                features.setdefault(name, [])  # named in a rejection, never decoded
            if len(features) > MAX_FEATURES:
                raise BadExample(f"more than {MAX_FEATURES} features")
    return features


def _record(data: bytes, image_key: str, label_key: str) -> Mapping[str, Any]:
    features = parse_example(data, {image_key, label_key}, limit=1)
    image, label = features.get(image_key), features.get(label_key)
    if not image or not isinstance(image[0], bytes):
        raise BadExample(f"no bytes feature {image_key!r} (the image; --image-key names another); it has "
                         f"{sorted(features)[:20]}")
    if not label or not isinstance(label[0], int):
        raise BadExample(f"no int64 feature {label_key!r} (the label; --label-key names another); it has "
                         f"{sorted(features)[:20]}")
    if not 0 <= label[0] <= MAX_LABEL:
        raise BadExample(f"label {label[0]} is outside 0-{MAX_LABEL}")
    return {"image": image[0], "label": int(label[0])}


def _rejected(reason: str) -> Callable[[], Mapping[str, Any]]:
    def load() -> Mapping[str, Any]:
        raise BadExample(reason)
    return load


def frames(name: str, stream: Any) -> Iterator[tuple[str, Optional[bytes], str]]:
    """``(position, bytes or None, why not)`` of each frame of the TFRecord file ``stream`` (binary), in order."""
    number = 0
    while True:
        position = f"{name}#{number}"
        head = stream.read(12)
        if not head:
            return
        if len(head) < 12:
            yield position, None, "the file ends inside a frame's header (truncated): nothing more is read"
            return
        length, length_crc = struct.unpack("<QI", head)
        if masked_crc(head[:8]) != length_crc:
            yield position, None, "a frame's length fails its CRC (not a TFRecord file, or corrupt): nothing more " \
                                  "of this file is read"
            return
        if length > MAX_RECORD_BYTES:
            yield position, None, f"a frame of {length} bytes, more than {MAX_RECORD_BYTES}: nothing more is read"
            return
        data = stream.read(length)
        tail = stream.read(4)
        if len(data) < length or len(tail) < 4:
            yield position, None, "the file ends inside a frame (truncated): nothing more is read"
            return
        if masked_crc(data) != struct.unpack("<I", tail)[0]:
            yield position, None, "the frame's bytes fail their CRC (corrupt)"
        else:
            yield position, data, ""
        number += 1


def tfrecord_items(sources: Sequence[str], storage_options: Optional[dict[str, Any]] = None,
                   image_key: str = IMAGE_KEY, label_key: str = LABEL_KEY) -> Iterator[Item]:
    """Every Example of the TFRecord files ``sources`` name: files, folders (every file in them) or fsspec URLs
    with globs (``s3://bucket/train-*``), in sorted order. OSError for a source that names nothing."""
    import fsspec

    for source in sources:
        fs, _, paths = fsspec.get_fs_token_paths(source, storage_options=storage_options or {})
        if len(paths) == 1 and fs.isdir(paths[0]):
            paths = [p for p in fs.find(paths[0]) if not p.rsplit("/", 1)[-1].startswith(".")]
        if not paths:
            raise OSError(f"{source}: no TFRecord file there (give files, a folder of them, or a glob)")
        for path in sorted(paths):
            with fs.open(path, "rb") as stream:
                for position, data, why in frames(path, stream):
                    if data is None:
                        yield position, _rejected(why)
                    else:
                        yield position, lambda data=data: _record(data, image_key, label_key)
