"""Writes a Stoker LMDB so that it is never seen half-built, also with several writers at once.

``write_records.write_lmdb(path, records)`` is the entry point from Python: any iterable of record dicts,
checked (bad records reported by position), with a progress bar. ``DatasetWriter`` is the
lower level both it and ``stoker lmdb build``/``synth`` use.

Records go into a directory of this build's own, ``OUT.partial-XXXXXXXX``, in
batched transactions; the metadata record is written last and the directory is
renamed to ``OUT`` only after that commit. A crash leaves its partial directory
behind, never an ``OUT`` that looks complete; the next build removes it.

Each build holds an ``flock`` on ``building.lock`` inside its partial directory,
so a build removes only partial directories whose builder is gone, never one
another process is writing; the publish is one ``rename`` (``partial_folders.py``).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lmdb

from stoker.producer.dataset.build.partial_folders import lock_new_partial, publish_partial, remove_abandoned_partials
from stoker.producer.dataset.sources.lmdb_format import (MAX_RECORD_BYTES, META_KEY, DatasetError, DatasetMeta,
                                                         FieldKind, encode_meta, record_key)
from stoker.producer.dataset.sources.record_codec import check_value, encode_record, kind_of
from stoker.producer.images.decode import sniff_format

_INITIAL_MAP_SIZE = 1 << 30
_COMMIT_EVERY = 256
_INT = FieldKind("int")


def built_meta(count: int, fields: Mapping[str, FieldKind], classes: Sequence[str], label_counts: Mapping[int, int],
               task: str = "", info: Optional[Mapping[str, Any]] = None) -> DatasetMeta:
    """A finished build's metadata: with ``classes`` and an int ``label`` whose every value names one of them, the
    records per class too (``class_counts``)."""
    counts = tuple(label_counts.get(label, 0) for label in range(len(classes)))
    return DatasetMeta(count=count, fields=dict(fields), classes=tuple(classes), task=task, info=dict(info or {}),
                       class_counts=counts if classes and sum(counts) == count else None)


class DatasetWriter:
    """Append records with add(); finish() publishes the dataset (format version 2).

    ``schema`` maps field names to kinds (``"image"``, ``"int"``, ``"array:float32:2"``, FieldKind...);
    without it the schema is inferred from the first record that passes the checks (``schema_from``
    names it), every declared kind in ``kinds`` taken as given (a folder build knows ``image`` is an
    image before any file is read, so a broken first file cannot turn the image checks off); every
    record must follow the schema (add() raises ValueError naming the field). Raises DatasetError if ``out`` exists and ``overwrite``
    is false, at construction or, if another process published ``out`` while this one wrote, at
    finish(). Leaving the context without finish() (an exception) deletes this build's partial directory.
    """

    def __init__(self, out: str | os.PathLike, overwrite: bool = False,
                 schema: Optional[Mapping[str, Any]] = None, kinds: Optional[Mapping[str, Any]] = None) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        self.schema: Optional[dict[str, FieldKind]] = (
            {name: FieldKind.parse(kind) for name, kind in schema.items()} if schema is not None else None)
        self.kinds = {name: FieldKind.parse(kind) for name, kind in (kinds or {}).items()}
        #: which record the schema was inferred from ("" while declared or not known yet)
        self.schema_from = ""
        if self.out.exists() and not overwrite:
            raise DatasetError(f"{self.out} already exists; pass --overwrite to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_partials(self.out)
        self.partial, self._lock = lock_new_partial(self.out)
        self._map_size = _INITIAL_MAP_SIZE
        self._env = lmdb.open(str(self.partial), map_size=self._map_size, subdir=True, lock=True)
        self._pending: list[tuple[bytes, bytes]] = []
        self.count = 0
        self.bytes_added = 0  #: encoded bytes of the records added (a sharded build closes a shard on it)
        #: records added per value of an int ``label`` field; finish() stores them as the per-class counts
        self.label_counts: Counter[int] = Counter()
        self._finished = False

    def check(self, record: Mapping[str, Any]) -> dict[str, FieldKind]:
        """The schema ``record`` follows (the dataset's, or inferred from it if there is none yet).

        ValueError naming the field if it does not follow the dataset's schema.
        """
        if not isinstance(record, Mapping) or not record:
            raise ValueError(f"a record must be a non-empty dict of fields, got {type(record).__name__}")
        schema = self.schema
        if schema is None:  # inferred from this record, which must then pass the checks itself
            missing = [n for n in self.kinds if n not in record]
            if missing:
                raise ValueError(f"record has fields {sorted(record)}, the dataset's include {sorted(self.kinds)} "
                                 f"(missing {missing})")
            schema = {}
            for name, value in record.items():
                if value is None:
                    raise ValueError(f"field {name!r} is None: leave it out of every record or store a value")
                schema[str(name)] = self.kinds.get(str(name)) or kind_of(
                    value, is_image=lambda data: sniff_format(data) is not None)
        missing = [n for n in schema if n not in record]
        extra = [n for n in record if n not in schema]
        if missing or extra:
            raise ValueError(f"record has fields {sorted(record)}, the dataset's are {sorted(schema)}"
                             + (f" (missing {missing})" if missing else "") + (f" (not in the schema {extra})" if extra else ""))
        for name, kind in schema.items():
            problem = check_value(name, record[name], kind)
            if problem:
                raise ValueError(problem)
        return schema

    def add(self, record: Mapping[str, Any], position: str = "") -> int:
        """Check and queue one record; returns its index. ValueError naming the field if it is unusable.

        ``position`` names the record (a file, ``record 3``) if the schema is inferred from it.
        """
        schema = self.check(record)
        encoded = encode_record(record)
        if len(encoded) > MAX_RECORD_BYTES:
            raise ValueError(f"record is {len(encoded)} bytes, more than the {MAX_RECORD_BYTES} allowed")
        if self.schema is None:
            self.schema_from = position or f"record {self.count}"
        self.schema = schema
        if schema.get("label") == _INT:
            self.label_counts[int(record["label"])] += 1
        index = self.count
        self.bytes_added += len(encoded)
        self._pending.append((record_key(index), encoded))
        self.count += 1
        if len(self._pending) >= _COMMIT_EVERY:
            self._flush()
        return index

    def _put_all(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in items:
                        txn.put(key, value)
                return
            except lmdb.MapFullError:
                # The map is virtual address space, not disk: doubling is cheap.
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)

    def _flush(self) -> None:
        if self._pending:
            self._put_all(self._pending)
            self._pending = []

    def finish(self, classes: Sequence[str] = (), task: str = "", info: Optional[Mapping[str, Any]] = None) -> DatasetMeta:
        """Write the metadata record last, then rename the directory into place.

        With ``classes`` and an int ``label`` field whose every value names one of them, the metadata
        also holds the records per class (``class_counts``).
        """
        self._flush()
        if self.schema is None or not self.count:
            raise DatasetError(f"no record was written to {self.out}: nothing to publish")
        meta = built_meta(self.count, self.schema, classes, self.label_counts, task, info)
        self._put_all([(META_KEY, encode_meta(meta))])
        self._env.sync(True)
        self._env.close()
        self._publish()
        self._finished = True
        return meta

    def _publish(self) -> None:
        publish_partial(self.partial, self.out, self.overwrite, self._lock)

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if not self._finished:
            try:
                self._env.close()
            finally:
                shutil.rmtree(self.partial, ignore_errors=True)
                self._lock.close()
