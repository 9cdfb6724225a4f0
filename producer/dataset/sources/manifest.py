"""A sharded dataset's manifest (docs/format.md, "Sharded datasets"): what ``manifest.json`` says and the checks it
passes before a reader trusts it.

``DATASET/manifest.json`` is ``{"format": "stoker-shards", "version": 1, "count": N, "fields": ..., "shards": [...]}``:
every shard's name, record count, size in bytes and SHA-256 of its one object (an LMDB shard's ``data.mdb``; so a
reader that fetched a shard from object storage can check it before use), and the dataset's schema and classes.
Two optional keys say what the shards are and where: ``"shard_format"`` (``lmdb``, the default; ``tar``:
WebDataset tars; ``parquet``) and ``"root"`` (an fsspec URL or an absolute path holding the shard objects; absent:
the manifest's own folder). An LMDB shard is named ``shard-NNNNN`` (its object ``shard-NNNNN/data.mdb``); a tar
or Parquet shard by its object path relative to the root (``000123.tar``, ``train/part-0001.parquet``). Such a
manifest for data left where it lies is an *index* (``stoker data index`` writes it, anywhere).

A manifest that does not describe a dataset (counts that do not add up, names that are not the format's, a path
that climbs out of the root, more than ``MAX_SHARDS``) is a DatasetError naming what is wrong.
``sharded.ShardedDataset`` reads the dataset it describes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import numpy as np

from stoker.protocol.input_state import MAX_RECORDS

from stoker.producer.dataset.sources.lmdb_format import MAX_LMDB_RECORDS, DatasetError, DatasetMeta, FieldKind
from stoker.producer.dataset.sources.shard_table.columns import MAX_OBJECT_PATH, table_of_json
from stoker.producer.dataset.sources.shard_table.table import ShardInfo, ShardTable

__all__ = ["Manifest", "ShardInfo", "ShardTable", "parse_manifest", "MANIFEST", "MAX_SHARDS", "MAX_MANIFEST_BYTES",
           "MAX_OBJECT_PATH", "SHARD_FORMATS"]

MANIFEST = "manifest.json"
FORMAT = "stoker-shards"
VERSION = 1
MAX_SHARDS = 1 << 20  # 1,048,576: LAION-5B in tars of 10^4 samples is ~5.8 x 10^5 (shard_table: ~90 bytes each)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024  # 10^6 tar shards' JSON is ~145 MB
_SHARD_NAME = re.compile(r"shard-[0-9]{5,6}")  # fullmatch: no trailing newline, ASCII digits only
_SHA256 = re.compile(r"[0-9a-f]{64}")
SHARD_FORMATS = ("lmdb", "tar", "parquet")
MAX_ROOT = 4096
_OBJECT_PATH = re.compile(r"[\x20-\x5b\x5d-\x7e]+")  # printable ASCII but the backslash: one spelling on every OS


@dataclass(frozen=True)
class Manifest:
    meta: DatasetMeta  # the whole dataset's: count, fields, classes, per-class counts
    #: a ShardTable (arrays; ShardInfo made on demand); a sequence of ShardInfo given is made one (firsts recomputed)
    shards: ShardTable
    shard_format: str = "lmdb"  # one of SHARD_FORMATS: how each shard object is read (shard_format.shard_format)
    root: Optional[str] = None  # where the shard objects are (URL or absolute path); None: beside the manifest

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.of(self.shards))

    def shard_of(self, index: int) -> int:
        """The shard holding global record ``index`` (the last of any empty shards before it is passed over)."""
        if not 0 <= index < self.meta.count:
            raise IndexError(f"record {index} is outside the dataset's {self.meta.count}")
        return int(np.searchsorted(self.shards.first, index, "right")) - 1

    @cached_property
    def records_per_shard(self) -> int:
        """The records every shard holds (the last may hold fewer), 0 if they differ: an elastic pool's epochs are
        two-level shuffles (shards, then records within them) only over such a layout, which is one number."""
        records = self.shards.records
        first = int(records[0])
        if len(records) < 2 or (records[:-1] != first).any() or records[-1] > first:
            return 0
        return first

    @property
    def mean_shard_records(self) -> int:
        """The records of a shard on average, rounded up: the block of an epoch's order over shards of unequal
        record counts (``serve/sharding.layout_block``): a block touches the shards its records lie in, one or two
        where shards are near the mean (``serve/block_layout.py``)."""
        return -(-self.meta.count // len(self.shards))

    def head(self) -> dict[str, Any]:
        """The manifest's JSON object but its ``shards``; an LMDB manifest without a root has no keys for them."""
        m = self.meta
        where = {"shard_format": self.shard_format} if self.shard_format != "lmdb" else {}
        if self.root is not None:
            where["root"] = self.root
        return {"format": FORMAT, "version": VERSION, **where, "count": m.count,
                "fields": {n: k.to_meta() for n, k in m.fields.items()}, "classes": list(m.classes),
                "class_counts": list(m.class_counts) if m.class_counts is not None else None,
                "task": m.task, "info": dict(m.info)}

    def to_json(self) -> str:
        """The manifest's JSON; an LMDB manifest without a root is written as before the keys existed."""
        return json.dumps({**self.head(), "shards": [{"name": s.name, "records": s.records, "bytes": s.bytes,
                                                      "sha256": s.sha256} for s in self.shards]}, indent=1)

    def to_compact(self) -> bytes:
        """This manifest in the binary form a daemon hands its workers (``shard_table.compact.parse_compact`` reads
        it back, checked as ``parse_manifest`` checks the JSON): no worker re-parses 10^6 shards of JSON."""
        from stoker.producer.dataset.sources.shard_table.compact import to_compact  # it builds on this module
        return to_compact(self)


def parse_manifest(data: bytes, where: str) -> Manifest:
    """A manifest's bytes, checked; DatasetError naming what is wrong (``where``: its path or URL)."""
    def bad(why: str) -> DatasetError:
        return DatasetError(f"{where}: not a Stoker sharded-dataset manifest: {why}")

    if len(data) > MAX_MANIFEST_BYTES:
        raise bad(f"{len(data)} bytes (at most {MAX_MANIFEST_BYTES})")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"invalid JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise bad(f"'format' is not {FORMAT!r}")
    shard_format, root = checked_head(body, bad)
    shards, count = body.pop("shards", None), body.get("count")
    if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_SHARDS:
        raise bad(f"'shards' must list 1-{MAX_SHARDS} shards")
    named = _lmdb_name_ok if shard_format == "lmdb" else _object_path_ok
    table = table_of_json(shards, shard_format, lambda s: _shard_ok(s, named), bad)
    del shards  # 10^6 dicts: gone before the meta is checked
    return Manifest(checked_meta(body, count, int(table.records.sum()), bad), table, shard_format, root)


def checked_head(body: dict, bad: Any) -> tuple[str, Optional[str]]:
    """The version, shard format and root of a manifest's JSON object (or a compact form's header), checked."""
    if body.get("version") != VERSION:
        raise bad(f"version {body.get('version')!r}; this Stoker reads version {VERSION}: upgrade it")
    shard_format, root = body.get("shard_format", "lmdb"), body.get("root")
    if shard_format not in SHARD_FORMATS:
        raise bad(f"'shard_format' {str(shard_format)[:40]!r} is none of {', '.join(SHARD_FORMATS)}")
    if root is not None and not _root_ok(root):
        raise bad(f"'root' must be an fsspec URL (s3://bucket/prefix) or an absolute path, printable, at most "
                  f"{MAX_ROOT} characters; got {str(root)[:80]!r}")
    return shard_format, root


def checked_meta(body: dict, count: Any, records: int, bad: Any) -> DatasetMeta:
    """The dataset's meta from ``body``, its ``count`` checked against the shards' ``records`` added up."""
    if not isinstance(count, int) or isinstance(count, bool) or count != records or not 0 < count <= MAX_RECORDS:
        raise bad(f"'count' {count!r} is not the shards' records added up ({records}), 1 to 2^40")
    return _meta(body, count, bad)


def _shard_ok(s: Any, named: Any) -> bool:
    """One shard of the JSON checked alone: the reference the column checks (``shard_table.columns``) agree with."""
    return bool(isinstance(s, dict) and isinstance(s.get("name"), str) and named(s["name"])
                and all(isinstance(s.get(k), int) and not isinstance(s.get(k), bool) and s[k] >= 0
                        for k in ("records", "bytes")) and s["records"] < MAX_LMDB_RECORDS
                and isinstance(s.get("sha256"), str) and _SHA256.fullmatch(s["sha256"]))


def _lmdb_name_ok(name: str) -> bool:
    return _SHARD_NAME.fullmatch(name) is not None


def _object_path_ok(name: str) -> bool:
    """A tar or Parquet shard's name: a path under the root that cannot leave it, spelt one way everywhere."""
    return (len(name) <= MAX_OBJECT_PATH and _OBJECT_PATH.fullmatch(name) is not None
            and all(part not in ("", ".", "..") for part in name.split("/")))


def _root_ok(root: Any) -> bool:
    return (isinstance(root, str) and 0 < len(root) <= MAX_ROOT and root.isprintable()
            and ("://" in root or root.startswith("/")))


def _meta(body: dict, count: int, bad: Any) -> DatasetMeta:
    fields = body.get("fields")
    if not isinstance(fields, dict) or not fields:
        raise bad("'fields' must map field names to kinds")
    try:
        kinds = {str(name): FieldKind.parse(kind) for name, kind in fields.items()}
    except (ValueError, TypeError, OverflowError, DatasetError) as exc:
        raise bad(f"'fields': {exc}") from None
    classes = body.get("classes") or []
    counts = body.get("class_counts")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise bad("'classes' must list class names")
    if counts is not None and not (isinstance(counts, list) and len(counts) == len(classes)
                                   and all(isinstance(n, int) and n >= 0 for n in counts) and sum(counts) == count):
        raise bad("'class_counts' must give one count per class, adding up to 'count'")
    task, info = body.get("task", ""), body.get("info", {})
    return DatasetMeta(count=count, fields=kinds, classes=tuple(classes), task=task if isinstance(task, str) else "",
                       info=info if isinstance(info, dict) else {},
                       class_counts=tuple(counts) if counts is not None else None)

