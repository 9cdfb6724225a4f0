"""Writing records from Python, checked: ``write_lmdb(path, records)`` (the entry point: any iterable of record
dicts, bad records reported by position, with a progress bar) and ``write_records``, the loop every builder
(folders, lists, JSON lines, TFRecord, WebDataset, synthetic data) drives a writer with (``DatasetWriter``, or
``ShardedWriter`` for a sharded dataset): records loaded and checked on a thread pool with bounded read-ahead,
added in order, and whatever is left out listed in the ``WriteReport`` with the reason.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, TypeVar

from tqdm import tqdm

from stoker.producer.dataset.build.lmdb_writer import DatasetWriter
from stoker.producer.dataset.build.sharded_writer import open_writer
from stoker.producer.dataset.sources.lmdb_format import DatasetMeta, FieldKind
from stoker.producer.images.decode import check_encoded_image, sniff_format


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
    with open_writer(path, shard_bytes, classes, overwrite=overwrite, schema=schema) as writer:
        items = ((f"record {i}", (lambda r=record: r)) for i, record in enumerate(records))
        write_records(writer, items, report, threads or os.cpu_count() or 1, progress, total, check_images,
                      label_classes=len(classes))
        report.meta = writer.finish(classes=classes, task=task, info=info)
    return report
