"""The Stoker LMDB dataset format, version 1 (specified in docs/format.md).

One LMDB environment (a directory holding data.mdb) with:
- one record per image under an 8-digit zero-padded ASCII key (b"00000000",
  b"00000001", ...): a msgpack map ``{"label": int, "image": bin}`` where
  ``image`` holds the encoded file bytes exactly as they were (JPEG or PNG);
- one metadata record under ``b"__stoker_meta__"``: a msgpack map
  ``{"format": "stoker-lmdb", "version": 1, "count": int, "classes": [str, ...]}``.

The metadata record is written last, in the final transaction, and builders
write to a temporary directory renamed into place at the end, so a dataset
with metadata is complete. Everything read back is validated; problems raise
DatasetError (whole dataset unusable) or RecordError (one record bad).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import lmdb
import msgpack

FORMAT_NAME = "stoker-lmdb"
FORMAT_VERSION = 1
META_KEY = b"__stoker_meta__"
MAX_RECORD_BYTES = 64 * 1024 * 1024


class DatasetError(RuntimeError):
    """The dataset as a whole cannot be used (missing, wrong format, other version)."""


class RecordError(ValueError):
    """One record is corrupt. ``key`` names it; the caller skips and counts it."""

    def __init__(self, key: bytes, message: str) -> None:
        super().__init__(f"record {key.decode(errors='replace')}: {message}")
        self.key = key


@dataclass(frozen=True)
class DatasetMeta:
    """What the metadata record says about a dataset."""

    count: int
    classes: tuple[str, ...]
    version: int = FORMAT_VERSION


def record_key(index: int) -> bytes:
    """The key of record ``index`` (0 <= index < 10**8)."""
    if not 0 <= index < 10**8:
        raise ValueError(f"record index {index} out of range for 8-digit keys")
    return b"%08d" % index


def encode_record(label: int, image_bytes: bytes) -> bytes:
    return msgpack.packb({"label": int(label), "image": bytes(image_bytes)}, use_bin_type=True)


def decode_record(key: bytes, value: bytes | memoryview | None, num_classes: int) -> tuple[int, bytes]:
    """Return ``(label, encoded_image_bytes)``; raise RecordError if the record is malformed."""
    if value is None:
        raise RecordError(key, "missing from the LMDB although the metadata counts it")
    if len(value) > MAX_RECORD_BYTES:
        raise RecordError(key, f"is {len(value)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        record = msgpack.unpackb(value, raw=False, strict_map_key=True)
    except Exception as exc:
        raise RecordError(key, f"is not a msgpack record ({exc})") from None
    if not isinstance(record, dict):
        raise RecordError(key, "is not a msgpack map")
    label, image = record.get("label"), record.get("image")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < max(num_classes, 1):
        raise RecordError(key, f"has label {label!r}, expected an integer in [0, {num_classes})")
    if not isinstance(image, bytes) or not image:
        raise RecordError(key, "has no encoded image bytes")
    return label, image


def encode_meta(meta: DatasetMeta) -> bytes:
    return msgpack.packb(
        {"format": FORMAT_NAME, "version": meta.version, "count": meta.count, "classes": list(meta.classes)},
        use_bin_type=True,
    )


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
    if version != FORMAT_VERSION:
        raise DatasetError(
            f"{path} is Stoker LMDB format version {version!r}, this Stoker reads version {FORMAT_VERSION}; "
            "rebuild the dataset with this release's `stoker lmdb build` or install the matching release"
        )
    count, classes = meta.get("count"), meta.get("classes")
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 10**8:
        raise DatasetError(f"{path}: metadata count {count!r} is not a valid record count")
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise DatasetError(f"{path}: metadata classes must be a non-empty list of names")
    return DatasetMeta(count=count, classes=tuple(classes), version=version)


class LmdbDataset:
    """Read-only access to a Stoker LMDB. Open one per process (LMDB handles do not survive fork).

    Raises DatasetError if the path is missing or not a Stoker dataset of this version.
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
        with self._env.begin(buffers=False) as txn:
            self.meta = decode_meta(self.path, txn.get(META_KEY))

    def __len__(self) -> int:
        return self.meta.count

    def read(self, index: int) -> tuple[int, bytes]:
        """``(label, encoded bytes)`` of record ``index``; RecordError if it is corrupt."""
        key = record_key(index)
        with self._env.begin(buffers=False) as txn:
            return decode_record(key, txn.get(key), len(self.meta.classes))

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
