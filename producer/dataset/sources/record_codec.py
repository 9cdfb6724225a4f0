"""How a Stoker LMDB record's values are stored and read back (docs/format.md): a record is a msgpack map of named
fields; a numpy array is msgpack extension type ``ARRAY_EXT`` (``[dtype, shape]`` then its raw little-endian
bytes). Both directions check everything: ``encode_record`` refuses values no field kind holds and names outside
``_NAME_RE``; ``decode_record`` bounds the record's size, every array's header and length, and holds the record to
the dataset's schema (``check_value``, which the writer uses too). Nothing is ever unpickled.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

import msgpack
import numpy as np

from stoker.producer.dataset.sources.lmdb_format import (ARRAY_EXT, MAX_MAP_DEPTH, MAX_RANK, MAX_RECORD_BYTES,
                                                         DatasetMeta, FieldKind, RecordError)
from stoker.protocol import ALLOWED_DTYPES

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def kind_of(value: Any, is_image: Optional[callable] = None) -> FieldKind:  # type: ignore[valid-type]
    """The FieldKind a value would be stored as; ValueError for values no kind holds.

    Byte strings are ``image`` when ``is_image(value)`` says so (the writer passes a content sniffer).
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return FieldKind("image" if is_image is not None and is_image(bytes(value)) else "bytes")
    if isinstance(value, (bool, np.bool_)):
        return FieldKind("bool")
    if isinstance(value, (int, np.integer)):
        return FieldKind("int")
    if isinstance(value, (float, np.floating)):
        return FieldKind("float")
    if isinstance(value, str):
        return FieldKind("str")
    if isinstance(value, np.ndarray):
        return FieldKind("array", value.dtype.name, value.ndim)
    if isinstance(value, (list, tuple)):
        _check_list(value)
        return FieldKind("list")
    if isinstance(value, dict):
        problem = map_problem(value)
        if problem:
            raise ValueError(problem)
        return FieldKind("map")
    raise ValueError(f"{type(value).__name__} cannot be stored: use bytes, int, float, bool, str, a list of "
                     "numbers/strings, a map of JSON values or a numeric numpy array")


def _check_list(value: Any, depth: int = 0) -> None:
    if depth > 8:
        raise ValueError("lists nest at most 8 deep")
    for item in value:
        if isinstance(item, (list, tuple)):
            _check_list(item, depth + 1)
        elif not isinstance(item, (bool, int, float, str, np.integer, np.floating)):
            raise ValueError(f"a list may hold numbers, strings and lists, not {type(item).__name__}")


def map_problem(value: Any) -> Optional[str]:
    """None if ``value`` is a map field's value: a dict of plain JSON values (str keys; str, int, float, bool,
    None, lists and dicts of them) nested at most ``MAX_MAP_DEPTH`` deep; else why not. Walked without recursion."""
    if not isinstance(value, dict):
        return f"a map must be a dict, got {type(value).__name__}"
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_MAP_DEPTH:
            return f"a map nests more than {MAX_MAP_DEPTH} deep"
        if isinstance(node, dict) and not all(isinstance(k, str) for k in node):
            return "a map's keys must be strings"
        for item in (node.values() if isinstance(node, dict) else node):
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif not (item is None or isinstance(item, (str, bool, int, float))):
                return f"a map may hold JSON values only, not {type(item).__name__}"
    return None


def _pack_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.name not in ALLOWED_DTYPES:
            raise ValueError(f"array dtype {value.dtype} is not one of {sorted(ALLOWED_DTYPES)}")
        array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        head = msgpack.packb([array.dtype.name, list(array.shape)])
        return msgpack.ExtType(ARRAY_EXT, head + array.tobytes())
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{type(value).__name__} cannot be stored")


def _unpack_ext(code: int, payload: bytes) -> Any:
    """Extension hook: arrays only, every length validated before use."""
    if code != ARRAY_EXT:
        raise ValueError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker(max_buffer_size=len(payload), max_str_len=32, max_array_len=MAX_RANK + 1,
                                max_map_len=0, max_bin_len=0, max_ext_len=0)
    unpacker.feed(payload)
    head = unpacker.unpack()
    if not (isinstance(head, list) and len(head) == 2 and isinstance(head[0], str) and isinstance(head[1], list)):
        raise ValueError("array header must be [dtype, shape]")
    dtype, shape = head
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"array dtype {dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
    if len(shape) > MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"array shape {shape!r} must be at most {MAX_RANK} integers >= 0")
    raw = memoryview(payload)[unpacker.tell():]
    expected = math.prod(shape) * np.dtype(dtype).itemsize  # Python ints: no overflow
    if raw.nbytes != expected:
        raise ValueError(f"array {dtype} {shape} needs {expected} bytes, the record holds {raw.nbytes}")
    return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).reshape(shape)


def encode_record(record: Mapping[str, Any]) -> bytes:
    """A record (field name -> value) as msgpack; ValueError naming the field that cannot be stored."""
    for name in record:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"field name {name!r} must match {_NAME_RE.pattern}")
    try:
        return msgpack.packb(dict(record), use_bin_type=True, default=_pack_default)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"record cannot be stored: {exc}") from None


def check_value(name: str, value: Any, want: FieldKind) -> Optional[str]:
    """None if ``value`` is of kind ``want``, else why not (used on write and on read)."""
    if want.kind == "image" or want.kind == "bytes":
        if not isinstance(value, (bytes, bytearray, memoryview)):
            return f"field {name!r} must be non-empty bytes, got {type(value).__name__}"
        if not len(value):
            return f"field {name!r} is empty (0 bytes)" + (": an empty file is not an image" if want.kind == "image" else "")
        return None
    if want.kind == "bool":
        ok = isinstance(value, (bool, np.bool_))
    elif want.kind == "int":
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    elif want.kind == "float":
        ok = isinstance(value, (float, int, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
    elif want.kind == "str":
        ok = isinstance(value, str)
    elif want.kind == "list":
        ok = isinstance(value, (list, tuple))
    elif want.kind == "map":
        problem = map_problem(value)
        return f"field {name!r}: {problem}" if problem else None
    else:  # array
        if not isinstance(value, np.ndarray):
            return f"field {name!r} must be a numpy array ({want}), got {type(value).__name__}"
        if value.dtype.name != want.dtype or value.ndim != want.ndim:
            return f"field {name!r} is {value.dtype} rank {value.ndim}, the dataset's schema says {want}"
        return None
    return None if ok else f"field {name!r} must be {want.kind}, got {type(value).__name__} {value!r:.60}"


def decode_record(key: bytes, value: bytes | memoryview | None, meta: DatasetMeta) -> dict[str, Any]:
    """The record's fields; RecordError if it is malformed or does not follow the dataset's schema."""
    if value is None:
        raise RecordError(key, "missing from the LMDB although the metadata counts it")
    if len(value) > MAX_RECORD_BYTES:
        raise RecordError(key, f"is {len(value)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        record = msgpack.unpackb(value, raw=False, strict_map_key=True, ext_hook=_unpack_ext)
    except Exception as exc:
        raise RecordError(key, f"is not a msgpack record ({exc})") from None
    if not isinstance(record, dict):
        raise RecordError(key, "is not a msgpack map")
    for name, want in meta.fields.items():
        if name not in record:
            raise RecordError(key, f"has no field {name!r} (fields: {', '.join(sorted(map(str, record)))})")
        problem = check_value(name, record[name], want)
        if problem:
            raise RecordError(key, problem)
    extra = [n for n in record if n not in meta.fields]
    if extra:
        raise RecordError(key, f"has fields {extra} that the dataset's schema does not list")
    if meta.version == 1:
        label = record["label"]
        if not 0 <= label < max(len(meta.classes), 1):
            raise RecordError(key, f"has label {label!r}, expected an integer in [0, {len(meta.classes)})")
    return record

