"""Writes a sharded dataset (``sources/sharded.py``): shards of a target size and the manifest, never seen half-built.

``ShardedWriter`` has the interface ``write_records.write_records`` drives (``schema``, ``kinds``, ``schema_from``,
``check``, ``add``, ``finish``), so every builder path (folders, lists, JSON lines, ``write_lmdb``) writes shards
with the same checks and report. Records go to ``shard-00000`` until its records' bytes reach ``shard_bytes``,
then to the next, each shard holding as many records as the first (one record count makes the layout an elastic
pool shuffles by, ``protocol/input_state.epoch_order``; shards' bytes vary with their records'). Each shard is
published by its own ``DatasetWriter`` inside this build's partial folder (``OUT.partial-XXXXXXXX``, locked as
the single-LMDB builder locks its own), its ``data.mdb`` hashed, and the manifest written last, then the folder renamed to ``OUT``. A crash leaves a partial folder that the next build
removes; never an ``OUT`` without its manifest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from stoker.producer.dataset.build.lmdb_writer import DatasetWriter, built_meta
from stoker.producer.dataset.build.partial_folders import lock_new_partial, publish_partial, remove_abandoned_partials
from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import MANIFEST, Manifest, ShardInfo

HASH_CHUNK = 8 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def parse_bytes(text: str) -> int:
    """``"256MB"``, ``"1.5GiB"``, ``"4096"`` -> bytes; ValueError naming the forms it takes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    number = text.strip().upper().rstrip()
    unit = number.lstrip("0123456789.")
    try:
        value = float(number[: len(number) - len(unit)])
        scale = units[unit.strip()]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, TB, KiB, MiB, GiB "
                         "or TiB (e.g. 256MB)") from None
    if value <= 0:
        raise ValueError(f"{text!r}: give a size > 0")
    return int(value * scale)


class ShardedWriter:
    """See the module doc. ``shard_bytes``: the first shard is closed once its records' encoded bytes reach it, and
    every later one at the first's record count;
    ``classes``: stored in every shard (so each reads alone with its class names) and the manifest."""

    def __init__(self, out: str | os.PathLike, shard_bytes: int, overwrite: bool = False,
                 schema: Optional[Mapping[str, Any]] = None, kinds: Optional[Mapping[str, Any]] = None,
                 classes: Sequence[str] = ()) -> None:
        if shard_bytes < 1:
            raise ValueError(f"shard size {shard_bytes}: give bytes >= 1")
        self.out, self.shard_bytes, self.overwrite = Path(out), shard_bytes, overwrite
        if self.out.exists() and not overwrite:
            raise DatasetError(f"{self.out} already exists; pass --overwrite to replace it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_partials(self.out)
        self.partial, self._lock = lock_new_partial(self.out)
        self.classes = tuple(classes)
        self.shards: list[ShardInfo] = []  # the closed shards' (filled by ``_closed`` as their closing ends)
        #: Closing a shard (its LMDB synced and closed, its file hashed: ~10% of a build) runs on this thread while
        #: the next shard is written; one thread, so shards close in order. Each LMDB transaction begins and
        #: commits within one call, so the closing thread never shares one with the writer's.
        self._closer = ThreadPoolExecutor(1, thread_name_prefix="stoker-shard-close")
        self._closing: list[Future] = []
        self._records_closed = 0
        self._opened = 0  # shards begun (their names' numbers)
        self._current_closing = False  # finish() handed the current shard to the closing thread
        #: every shard holds the first's record count (the first is cut at ``shard_bytes``): the layout an elastic
        #: pool's two-level epochs need is then one number (``Manifest.records_per_shard``)
        self.records_per_shard = 0
        self._closed_labels: Counter[int] = Counter()  # label counts of the shards closed so far
        self.count = 0
        self._schema = {n: FieldKind.parse(k) for n, k in schema.items()} if schema is not None else None
        self._kinds = dict(kinds or {})
        self._schema_from = ""
        self._finished = False
        self._current = self._new_shard()  # made here and in add(), on the builder's thread: check() runs on others

    # ---- what write_records uses -------------------------------------------------------------------

    @property
    def schema(self) -> Optional[dict[str, FieldKind]]:
        return self._current.schema if self._current.schema is not None else self._schema

    @property
    def kinds(self) -> dict[str, FieldKind]:
        return {n: FieldKind.parse(k) for n, k in self._kinds.items()}

    @property
    def schema_from(self) -> str:
        return self._schema_from or self._current.schema_from

    @property
    def label_counts(self) -> Counter[int]:
        """Records added per int ``label``, every shard's."""
        return self._closed_labels + self._current.label_counts

    def check(self, record: Mapping[str, Any]) -> dict[str, FieldKind]:
        return self._current.check(record)

    def add(self, record: Mapping[str, Any], position: str = "") -> int:
        """Check and add one record to the current shard; its global index. ValueError as DatasetWriter's."""
        writer = self._current
        writer.add(record, position)
        if not self._schema_from and writer.schema_from:
            self._schema_from = writer.schema_from
        self.count += 1
        if (writer.count >= self.records_per_shard if self.records_per_shard
                else writer.bytes_added >= self.shard_bytes):
            self._current = self._new_shard()  # if this fails, ``writer`` is still current, not closing
            self._close_shard(writer)
        return self.count - 1

    # ---- shards ------------------------------------------------------------------------------------

    def _new_shard(self) -> DatasetWriter:
        schema = {n: k.to_meta() for n, k in self._schema.items()} if self._schema is not None else None
        self._opened += 1
        return DatasetWriter(self.partial / f"shard-{self._opened - 1:05d}", schema=schema, kinds=self._kinds)

    def _close_shard(self, writer: DatasetWriter) -> None:
        """Hand ``writer``'s shard to the closing thread, once the shard before it closed (at most one closes at
        a time, and its error surfaces here, not at the end of the build)."""
        if not writer.count:
            writer.__exit__(None)  # an empty last shard: its partial folder goes
            return
        self._schema = dict(writer.schema or {})
        self._closed_labels.update(writer.label_counts)
        self.records_per_shard = self.records_per_shard or writer.count
        if self._closing:
            try:
                self._closing[-1].result()
            except BaseException:
                writer.__exit__(None)  # never queued: this thread closes it (and the build fails)
                raise
        self._closing.append(self._closer.submit(self._close, writer, self._records_closed, self.classes))
        self._records_closed += writer.count

    @staticmethod
    def _close(writer: DatasetWriter, first: int, classes: Sequence[str]) -> ShardInfo:
        meta = writer.finish(classes=classes)
        data = writer.out / "data.mdb"
        return ShardInfo(writer.out.name, first, meta.count, data.stat().st_size, file_sha256(data))

    def _closed(self) -> None:
        """Wait for every shard's closing; its error, if one failed."""
        self.shards = [future.result() for future in self._closing]

    def finish(self, classes: Sequence[str] = (), task: str = "", info: Optional[Mapping[str, Any]] = None) -> DatasetMeta:
        """Close the last shard, write the manifest last, rename the folder into place; the whole dataset's meta."""
        self.classes = tuple(classes) or self.classes
        self._current_closing = True
        self._close_shard(self._current)
        self._closed()
        if not self.shards or self._schema is None:
            raise DatasetError(f"no record was written to {self.out}: nothing to publish")
        meta = built_meta(self.count, self._schema, self.classes, self._closed_labels, task, info)
        manifest = self.partial / MANIFEST
        with open(manifest, "w") as f:
            f.write(Manifest(meta, tuple(self.shards)).to_json())
            f.flush()
            os.fsync(f.fileno())
        self._publish()
        self._finished = True
        return meta

    def _publish(self) -> None:
        publish_partial(self.partial, self.out, self.overwrite, self._lock)

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self._closer.shutdown(wait=True)  # no shard is closing (in LMDB, or into the partial folder) past here
        if not self._finished:
            try:
                if not self._current_closing:
                    self._current.__exit__(None)
            finally:
                shutil.rmtree(self.partial, ignore_errors=True)
                self._lock.close()


def open_writer(out: str | os.PathLike, shard_bytes: Optional[int] = None, classes: Sequence[str] = (),
                **writer_args: Any) -> "DatasetWriter | ShardedWriter":
    """The writer a build uses: one LMDB (``DatasetWriter``), or with ``shard_bytes`` a sharded dataset
    (``ShardedWriter``, every shard storing ``classes``). ``writer_args``: ``overwrite``, ``schema``, ``kinds``."""
    if shard_bytes:
        return ShardedWriter(out, shard_bytes, classes=classes, **writer_args)
    return DatasetWriter(out, **writer_args)
