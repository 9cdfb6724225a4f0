"""Writes a Stoker LMDB so that it is never seen half-built, also with several writers at once.

``write_lmdb(path, records)`` is the entry point from Python: any iterable of record dicts,
checked (bad records reported by position), with a progress bar. ``DatasetWriter`` is the
lower level both it and ``stoker lmdb build``/``synth`` use.

Records go into a directory of this build's own, ``OUT.partial-XXXXXXXX``, in
batched transactions; the metadata record is written last and the directory is
renamed to ``OUT`` only after that commit. A crash leaves its partial directory
behind, never an ``OUT`` that looks complete; the next build removes it.

Each build holds an ``flock`` on ``building.lock`` inside its partial directory,
so a build removes only partial directories whose builder is gone (the kernel
drops the lock when a process dies), never one another process is writing. The
publish is one ``rename``: without ``overwrite`` it fails rather than replace a
dataset another process published meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import tempfile
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, TypeVar

import lmdb
from tqdm import tqdm

from stoker.producer.dataset.format import (MAX_RECORD_BYTES, META_KEY, DatasetError, DatasetMeta, FieldKind, check_value,
                             encode_meta, encode_record, kind_of, record_key)
from stoker.producer.images.decode import check_encoded_image, sniff_format

_INITIAL_MAP_SIZE = 1 << 30
_COMMIT_EVERY = 256
_LOCK_NAME = "building.lock"
_INT = FieldKind("int")


def _lock_new_partial(out: Path) -> tuple[Path, IO[str]]:
    """A fresh partial directory for ``out`` and its held lock file."""
    while True:
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
        lock = open(partial / _LOCK_NAME, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.fstat(lock.fileno()).st_nlink:  # not removed by a cleaner between mkdtemp and flock
            return partial, lock
        lock.close()


def remove_abandoned_partials(out: Path) -> list[Path]:
    """Remove partial directories of ``out`` whose builder is gone; returns what was removed."""
    removed = []
    legacy = out.with_name(out.name + ".partial")  # from releases before per-build partial directories
    candidates = sorted(out.parent.glob(f"{out.name}.partial-*")) + ([legacy] if legacy.is_dir() else [])
    for partial in candidates:
        lock_path = partial / _LOCK_NAME
        try:
            lock = open(lock_path, "r")
        except FileNotFoundError:
            if partial == legacy:
                shutil.rmtree(partial, ignore_errors=True)
                removed.append(partial)
            continue  # being created right now (its lock file comes next), or not ours
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its builder is alive
            os.unlink(lock_path)  # a builder that locks this file next sees it unlinked and starts afresh
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
    return removed


def publish_partial(partial: Path, out: Path, overwrite: bool, lock: IO[str]) -> None:
    """Rename a finished build's ``partial`` folder to ``out`` (atomic), releasing its ``lock``. With ``overwrite``
    an existing ``out`` is replaced; without, DatasetError if another process published ``out`` meanwhile."""
    os.unlink(partial / _LOCK_NAME)  # still held through the open descriptor until close
    replaced = None
    if overwrite and out.exists():
        replaced = out.with_name(f"{out.name}.replaced-{secrets.token_hex(4)}")
        os.rename(out, replaced)
    try:
        os.rename(partial, out)  # atomic; refuses to replace a non-empty directory
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise DatasetError(f"{out} was published by another process while this build ran; "
                           "pass --overwrite to replace it") from None
    finally:
        lock.close()
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)


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
        self.partial, self._lock = _lock_new_partial(self.out)
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


@dataclass
class WriteReport:
    """What a write did: the published metadata and every record left out, by position, with the reason."""

    meta: Optional[DatasetMeta] = None
    skipped: list[tuple[str, str]] = dataclass_field(default_factory=list)
    #: where the schema came from: "declared", or the record it was inferred from
    schema_from: str = ""
    #: things the user should look at although nothing was lost (e.g. images in a field inferred as bytes)
    warnings: list[str] = dataclass_field(default_factory=list)


T = TypeVar("T")


def map_ahead(fn: Callable[[T], Any], items: Iterable[T], threads: int) -> Iterator[tuple[T, Any]]:
    """``(item, fn(item))`` in input order, ``fn`` run on ``threads`` threads, at most ``4 * threads`` ahead.

    Bounded read-ahead keeps memory flat however long ``items`` is (decoders release the GIL).
    """
    window = 4 * max(1, threads)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        pending: deque = deque()
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= window:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def _image_problems(record: Mapping[str, Any], schema: Mapping[str, FieldKind]) -> Optional[str]:
    """Why an image field of ``record`` cannot be decoded by the producers (the field named if there are several)."""
    images = [name for name, kind in schema.items() if kind.kind == "image"]
    for name in images:
        reason = check_encoded_image(bytes(record[name]))
        if reason:
            return f"field {name!r}: {reason}" if len(images) > 1 else reason
    return None


def write_records(writer: DatasetWriter, items: Iterable[tuple[str, Callable[[], Mapping[str, Any]]]],
                  report: WriteReport, threads: int, progress: bool, total: Optional[int],
                  check_images: bool = True, label_classes: int = 0) -> None:
    """Load, check and add ``(position, load)`` items in order; bad ones go to ``report.skipped``.

    ``load()`` returns the record (it may read files; it runs on the thread pool) or raises ValueError
    or OSError saying why it cannot. ``label_classes`` > 0 checks an int ``label`` field is below it.
    """
    def prepare(item: tuple[str, Callable[[], Mapping[str, Any]]]) -> tuple[Optional[Mapping[str, Any]], str, bool]:
        """(record or None, reason, whether its images were checked) on a pool thread."""
        try:
            record = item[1]()
            if label_classes and isinstance(record.get("label"), int) and not 0 <= record["label"] < label_classes:
                return None, f"field 'label' is {record['label']}, outside the {label_classes} classes", True
            schema = writer.schema  # set by the main thread once the first record is in
            if schema is None or not check_images:
                return record, "", not check_images
            writer.check(record)
            problem = _image_problems(record, schema)
            return (None, problem, True) if problem else (record, "", True)
        except OSError as exc:
            return None, f"unreadable ({exc.strerror or exc})", True
        except ValueError as exc:
            return None, str(exc), True

    declared = writer.schema is not None
    images_in_bytes: dict[str, int] = {}  # inferred ``bytes`` fields -> later records holding an image there
    bar = tqdm(total=total, desc="write", unit="rec", disable=not progress)
    for (position, _), (record, reason, images_checked) in map_ahead(prepare, items, threads):
        if record is not None:
            try:
                if not images_checked:  # prepared before the schema was known (the first few records)
                    problem = _image_problems(record, writer.check(record))
                    if problem:
                        raise ValueError(problem)
                known = writer.schema is not None
                writer.add(record, position)
                if known and not declared:
                    for name, kind in writer.schema.items():  # type: ignore[union-attr]
                        if kind.kind == "bytes" and name not in writer.kinds and sniff_format(bytes(record[name])):
                            images_in_bytes[name] = images_in_bytes.get(name, 0) + 1
            except ValueError as exc:
                record, reason = None, str(exc)
        if record is None:
            report.skipped.append((position, reason))
            if progress:  # tqdm writes even when disabled; quiet callers list report.skipped themselves
                bar.write(f"skipped {position}: {reason}")
        bar.update(1)
    bar.close()
    report.schema_from = "declared" if declared else writer.schema_from
    for name, count in sorted(images_in_bytes.items()):
        report.warnings.append(
            f"field {name!r} was inferred as bytes from {writer.schema_from}, which holds no image, but {count} later "
            f"record(s) hold images there, stored unchecked: if {name!r} is an image field, declare it "
            f"(write_lmdb(..., schema={{{name!r}: 'image', ...}}), or --image-field {name} for --jsonl) and rebuild")


def write_lmdb(path: str | os.PathLike, records: Iterable[Mapping[str, Any]], *,
               schema: Optional[Mapping[str, Any]] = None, classes: Sequence[str] = (), task: str = "",
               info: Optional[Mapping[str, Any]] = None, overwrite: bool = False, progress: bool = True,
               total: Optional[int] = None, check_images: bool = True, threads: Optional[int] = None,
               shard_bytes: Optional[int] = None) -> WriteReport:
    """Write any iterable of record dicts to a Stoker LMDB at ``path``, atomically.

    Each record is a dict of fields: encoded images (bytes, kept as they are), other bytes, int,
    float, bool, str, lists, and numeric numpy arrays (boxes, keypoints, class lists). The schema
    comes from ``schema`` or the first record; a record that does not follow it, or whose image
    does not decode (or is over 8192 x 8192 pixels), is skipped and reported by position in the
    returned WriteReport, never silently. ``classes`` names the classes of an int ``label`` field
    (checked); ``task`` and ``info`` are stored in the metadata. Nothing appears at ``path`` until the
    whole dataset is written. Shows a progress bar (``total`` sizes it) unless ``progress`` is false.

    ``shard_bytes``: write a sharded dataset of shards of about that size (``sharded_writer.py``).

    >>> write_lmdb("train.lmdb", ({"image": open(p, "rb").read(), "label": y} for p, y in items))
    """
    if total is None and hasattr(records, "__len__"):
        total = len(records)  # type: ignore[arg-type]
    report = WriteReport()
    from stoker.producer.dataset.sharded_writer import open_writer  # it builds on this module

    with open_writer(path, shard_bytes, classes, overwrite=overwrite, schema=schema) as writer:
        items = ((f"record {i}", (lambda r=record: r)) for i, record in enumerate(records))
        write_records(writer, items, report, threads or os.cpu_count() or 1, progress, total, check_images,
                      label_classes=len(classes))
        report.meta = writer.finish(classes=classes, task=task, info=info)
    return report
