"""The Stoker LMDB dataset format, versions 2 and 1 (specified in docs/format.md).

One LMDB environment (a directory holding data.mdb) with:
- one record per sample under an 8-digit zero-padded ASCII key (b"00000000",
  b"00000001", ...): a msgpack map of named fields;
- one metadata record under ``b"__stoker_meta__"``: a msgpack map
  ``{"format": "stoker-lmdb", "version": 2, "count": int, "fields": {name: kind}, ...}``.

Field kinds: ``image`` (an encoded image, stored as it was), ``bytes``, ``int``,
``float``, ``bool``, ``str``, ``list`` (nested lists of numbers and strings), ``map`` (a JSON object of plain
JSON values, at most ``MAX_MAP_DEPTH`` deep: a WebDataset ``.json`` member; stored as a msgpack map) and
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

This module holds what the format *is*: its names and limits, the field kinds, the metadata record
(``encode_meta``/``decode_meta``) and the record keys. How a record's values are stored is ``record_codec``;
opening an LMDB and reading its records is ``lmdb_dataset.LmdbDataset``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import msgpack

from stoker.protocol import ALLOWED_DTYPES

FORMAT_NAME = "stoker-lmdb"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
META_KEY = b"__stoker_meta__"
MAX_RECORD_BYTES = 64 * 1024 * 1024
ARRAY_EXT = 1
KINDS = ("image", "bytes", "int", "float", "bool", "str", "list", "array", "map")
MAX_MAP_DEPTH = 32  # of a map field's nesting
MAX_RANK = 8  # of an array field


class DatasetError(RuntimeError):
    """The dataset as a whole cannot be used (missing, wrong format, other version)."""


class RecordError(ValueError):
    """One record is corrupt. ``key`` names it; the caller skips and counts it."""

    def __init__(self, key: bytes, message: str) -> None:
        super().__init__(f"record {key.decode(errors='replace')}: {message}")
        self.key, self.reason = key, message


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
            if not 0 <= self.ndim <= MAX_RANK:
                raise ValueError(f"array rank {self.ndim} must be 0..{MAX_RANK}")

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


#: Records one LMDB holds at most: its keys are 8 digits (a sharded dataset's total is the protocol's bound, 2**40).
MAX_LMDB_RECORDS = 10**8


def record_key(index: int) -> bytes:
    """The key of record ``index`` (0 <= index < ``MAX_LMDB_RECORDS``)."""
    if not 0 <= index < MAX_LMDB_RECORDS:
        raise ValueError(f"record index {index} out of range for 8-digit keys")
    return b"%08d" % index


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
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < MAX_LMDB_RECORDS:
        raise DatasetError(f"{path}: metadata count {count!r} is not a valid record count (0 to 10^8 - 1)")
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

