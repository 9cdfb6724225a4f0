"""The Stoker LMDB dataset format, versions 2 and 1 (specified in docs/format.md).

One LMDB environment (a directory holding data.mdb) with:
- one record per sample under an 8-digit zero-padded ASCII key (b"00000000",
  b"00000001", ...): a msgpack map of named fields;
- one metadata record under ``b"__stoker_meta__"``: a msgpack map
  ``{"format": "stoker-lmdb", "version": 2, "count": int, "fields": {name: kind}, ...}``.

Field kinds: ``image`` (an encoded image, stored as it was), ``bytes``, ``int``,
``float``, ``bool``, ``str``, ``list`` (nested lists of numbers and strings) and
``array``: a numpy array carried as msgpack extension type 1 whose payload is a
msgpack ``[dtype, shape]`` followed by the raw little-endian C-order bytes. Only
the numeric dtypes of the wire protocol are allowed and every length is checked
before a byte is used: nothing is ever unpickled (msgpack-numpy is not used for
the reason docs/decisions.md gives).

The optional metadata ``class_counts`` (records per class, by label) is absent from datasets built
before Stoker stored it; readers treat that as unknown, never as an error.

Version 1 datasets (``{"label": int, "image": bin}`` records, ``classes`` in the
metadata) are read as records with an ``image`` and a ``label`` field.

The metadata record is written last, in the final transaction, and builders
write to a directory of their own renamed into place at the end, so a dataset
with metadata is complete. Everything read back is validated; problems raise
DatasetError (whole dataset unusable) or RecordError (one record bad).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import lmdb
import msgpack
import numpy as np

from stoker.protocol import ALLOWED_DTYPES

FORMAT_NAME = "stoker-lmdb"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
META_KEY = b"__stoker_meta__"
MAX_RECORD_BYTES = 64 * 1024 * 1024
ARRAY_EXT = 1
KINDS = ("image", "bytes", "int", "float", "bool", "str", "list", "array")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_MAX_RANK = 8


class DatasetError(RuntimeError):
    """The dataset as a whole cannot be used (missing, wrong format, other version)."""


class RecordError(ValueError):
    """One record is corrupt. ``key`` names it; the caller skips and counts it."""

    def __init__(self, key: bytes, message: str) -> None:
        super().__init__(f"record {key.decode(errors='replace')}: {message}")
        self.key = key


@dataclass(frozen=True)
class FieldKind:
    """What one field of every record holds: a kind, plus dtype and rank for arrays."""

    kind: str
    dtype: str = ""
    ndim: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"field kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "array":
            if self.dtype not in ALLOWED_DTYPES:
                raise ValueError(f"array dtype {self.dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
            if not 0 <= self.ndim <= _MAX_RANK:
                raise ValueError(f"array rank {self.ndim} must be 0..{_MAX_RANK}")

    @classmethod
    def parse(cls, value: Any) -> "FieldKind":
        """From the metadata map, a kind name, ``"array:float32:2"``, or a FieldKind."""
        if isinstance(value, FieldKind):
            return value
        if isinstance(value, str):
            kind, _, rest = value.partition(":")
            dtype, _, ndim = rest.partition(":")
            return cls(kind, dtype, int(ndim) if ndim else -1)
        if isinstance(value, Mapping):
            return cls(str(value.get("kind")), str(value.get("dtype", "")), int(value.get("ndim", -1)))
        raise ValueError(f"cannot read a field kind from {value!r}")

    def to_meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "ndim": self.ndim} if self.kind == "array" else {"kind": self.kind}

    def __str__(self) -> str:
        return f"array {self.dtype} rank {self.ndim}" if self.kind == "array" else self.kind


@dataclass(frozen=True)
class DatasetMeta:
    """What the metadata record says about a dataset."""

    count: int
    fields: Mapping[str, FieldKind]
    classes: tuple[str, ...] = ()
    task: str = ""
    info: Mapping[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    #: records per class (index = label); None where the metadata does not say (datasets built before
    #: Stoker stored it, or without an int ``label`` field)
    class_counts: Optional[tuple[int, ...]] = None


V1_FIELDS = {"image": FieldKind("image"), "label": FieldKind("int")}


def record_key(index: int) -> bytes:
    """The key of record ``index`` (0 <= index < 10**8)."""
    if not 0 <= index < 10**8:
        raise ValueError(f"record index {index} out of range for 8-digit keys")
    return b"%08d" % index


# ---- values ------------------------------------------------------------------------------------

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
    raise ValueError(f"{type(value).__name__} cannot be stored: use bytes, int, float, bool, str, a list of "
                     "numbers/strings or a numeric numpy array")


def _check_list(value: Any, depth: int = 0) -> None:
    if depth > 8:
        raise ValueError("lists nest at most 8 deep")
    for item in value:
        if isinstance(item, (list, tuple)):
            _check_list(item, depth + 1)
        elif not isinstance(item, (bool, int, float, str, np.integer, np.floating)):
            raise ValueError(f"a list may hold numbers, strings and lists, not {type(item).__name__}")


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
    unpacker = msgpack.Unpacker(max_buffer_size=len(payload), max_str_len=32, max_array_len=_MAX_RANK + 1,
                                max_map_len=0, max_bin_len=0, max_ext_len=0)
    unpacker.feed(payload)
    head = unpacker.unpack()
    if not (isinstance(head, list) and len(head) == 2 and isinstance(head[0], str) and isinstance(head[1], list)):
        raise ValueError("array header must be [dtype, shape]")
    dtype, shape = head
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"array dtype {dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
    if len(shape) > _MAX_RANK or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"array shape {shape!r} must be at most {_MAX_RANK} integers >= 0")
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


# ---- metadata ----------------------------------------------------------------------------------

def encode_meta(meta: DatasetMeta) -> bytes:
    body: dict[str, Any] = {"format": FORMAT_NAME, "version": meta.version, "count": meta.count}
    if meta.version >= 2:
        body["fields"] = {name: kind.to_meta() for name, kind in meta.fields.items()}
        if meta.task:
            body["task"] = meta.task
        if meta.info:
            body["info"] = dict(meta.info)
        if meta.class_counts is not None:
            body["class_counts"] = list(meta.class_counts)
    body["classes"] = list(meta.classes)
    return msgpack.packb(body, use_bin_type=True)


def decode_meta(path: str | os.PathLike, value: bytes | None) -> DatasetMeta:
    """Validate the metadata record; DatasetError says what is wrong and how to fix it."""
    if value is None:
        raise DatasetError(
            f"{path} has no {META_KEY.decode()} record: it is not a Stoker dataset or its build did not finish; "
            "rebuild it with `stoker lmdb build` or `stoker lmdb synth`"
        )
    try:
        meta = msgpack.unpackb(value, raw=False, strict_map_key=True)
    except Exception as exc:
        raise DatasetError(f"{path}: metadata record is not valid msgpack ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DatasetError(f"{path}: metadata does not name format {FORMAT_NAME!r}")
    version = meta.get("version")
    if version not in READABLE_VERSIONS:
        raise DatasetError(
            f"{path} is Stoker LMDB format version {version!r}, this Stoker reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; rebuild the dataset with this release's `stoker lmdb build` "
            "or install the matching release"
        )
    count, classes = meta.get("count"), meta.get("classes", [])
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 10**8:
        raise DatasetError(f"{path}: metadata count {count!r} is not a valid record count")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise DatasetError(f"{path}: metadata classes must be a list of names")
    if version == 1:
        if not classes:
            raise DatasetError(f"{path}: metadata classes must be a non-empty list of names")
        return DatasetMeta(count=count, fields=V1_FIELDS, classes=tuple(classes), task="classification", version=1)
    raw_fields = meta.get("fields")
    if not isinstance(raw_fields, dict) or not raw_fields:
        raise DatasetError(f"{path}: metadata has no field schema")
    try:
        fields = {str(name): FieldKind.parse(kind) for name, kind in raw_fields.items()}
    except (ValueError, TypeError) as exc:
        raise DatasetError(f"{path}: metadata field schema is invalid ({exc})") from None
    task, info, counts = meta.get("task", ""), meta.get("info", {}), meta.get("class_counts")
    if counts is not None and not (isinstance(counts, list) and len(counts) == len(classes)
                                   and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
                                   and sum(counts) == count):
        raise DatasetError(f"{path}: metadata class_counts must be one count >= 0 per class, summing to {count}")
    return DatasetMeta(count=count, fields=fields, classes=tuple(classes), task=task if isinstance(task, str) else "",
                       info=info if isinstance(info, dict) else {}, version=2,
                       class_counts=tuple(counts) if counts is not None else None)


def _read_meta(path: Path, env: lmdb.Environment) -> DatasetMeta:
    """The metadata, once the file is known whole (past its end an mmap read is SIGBUS); DatasetError if not."""
    needed, size = (env.info()["last_pgno"] + 1) * env.stat()["psize"], (path / "data.mdb").stat().st_size
    try:
        if size < needed:
            raise DatasetError(f"{path / 'data.mdb'} is truncated: {size} bytes, but its LMDB uses {needed} bytes "
                               "of pages; copy it again from the source (or rebuild it with `stoker lmdb build`)")
        with env.begin(buffers=False) as txn:
            return decode_meta(path, txn.get(META_KEY))
    except lmdb.Error as exc:
        raise DatasetError(f"cannot read the metadata of the LMDB at {path} ({type(exc).__name__}: {exc}): the file "
                           "is damaged; copy it again from the source (or rebuild it)") from None


class LmdbDataset:
    """Read-only access to a Stoker LMDB. Open one per process (LMDB handles do not survive fork).

    Raises DatasetError if the path is missing or not a Stoker dataset of a readable version.
    Use as a context manager or call close().
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            raise DatasetError(
                f"no LMDB at {self.path} (expected {self.path / 'data.mdb'}); "
                "create one with `stoker lmdb build SRC OUT` or `stoker lmdb synth OUT`"
            )
        try:
            self._env = lmdb.open(str(self.path), readonly=True, lock=False, readahead=False, meminit=False, max_readers=512)
        except lmdb.Error as exc:
            raise DatasetError(f"cannot open LMDB at {self.path}: {exc}") from None
        try:
            self.meta = _read_meta(self.path, self._env)
        except DatasetError:
            self._env.close()
            raise

    def __len__(self) -> int:
        return self.meta.count

    def read(self, index: int) -> dict[str, Any]:
        """Record ``index`` as a dict of its fields; RecordError if it is corrupt."""
        key = record_key(index)
        try:
            with self._env.begin(buffers=False) as txn:
                return decode_record(key, txn.get(key), self.meta)
        except lmdb.Error as exc:  # a damaged page (MDB_CORRUPTED, MDB_PAGE_NOTFOUND...): this record is lost
            raise RecordError(key, f"cannot be read from {self.path}: {type(exc).__name__}: {exc}") from None

    def iter_raw(self, indices: list[int]) -> Iterator[tuple[int, bytes | None]]:
        """Yield ``(index, raw value or None)`` in one read transaction, for batch reads."""
        with self._env.begin(buffers=False) as txn:
            for index in indices:
                yield index, txn.get(record_key(index))

    def size_bytes(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> "LmdbDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
