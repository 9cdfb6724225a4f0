"""Build a Stoker LMDB from an image folder (one sub-folder per class), a list file or JSON lines.

Every image is checked before it is stored, by content, not by file name: it must
be an image the producers decode (``decode``: JPEG, PNG, WebP, BMP, GIF,
TIFF), within the pixel limit (read from the header, so a decompression bomb is
refused without decoding it), decode with the producers' own decoder, and (for
JPEG) carry its end-of-image marker. Nothing is lost silently: every file or line
that is not stored (not an image, too large, corrupt, unreadable, a broken link,
outside any class folder, a JSON line that does not parse) is reported with the
reason, and counted; the build still publishes the good ones. Checks run on a
thread pool with bounded read-ahead (the decoders release the GIL).

Sources:
- a folder ``SRC/<class>/<files>``: records ``{"image", "label"}``, classes in sorted order; files in
  nested sub-folders of a class folder belong to that class. A class folder with no image that can
  be stored is refused, naming it, as torchvision's ImageFolder does (``allow_empty_classes`` keeps
  it as a class with 0 records, with a warning): otherwise a stray or empty folder would silently
  become a label no record has;
- a list file of ``path label`` lines: the same fields, classes ``"0"``, ``"1"``, ...;
- JSON lines (``--jsonl``): one object per line; fields named by ``image_fields`` hold image
  paths (relative to the file's folder) and are stored as the images' bytes, every other
  field as its JSON value (numbers, strings, lists such as boxes ``[[x1, y1, x2, y2], ...]``).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from stoker.producer.dataset.build.sharded_writer import open_writer
from stoker.producer.dataset.build.write_records import WriteReport, write_records
from stoker.producer.images.decode import check_encoded_image  # noqa: F401  (re-exported: the builders' check)

SHARD_ORDER_SEED = 0  # the order a sharded build writes a folder's or list's files in: a fixed shuffle

BuildReport = WriteReport


class SourceError(ValueError):
    """The build source (folder, list file or JSON lines) cannot be used; the message says why."""


def scan_folder(src: Path) -> tuple[list[tuple[Path, int]], list[str], list[tuple[str, str]]]:
    """Items, class names and what was left out of an ImageNet-train-style folder (sorted, deterministic).

    Every regular file under a class folder, at any depth, is an item, whatever its name: its content decides
    (check_encoded_image). Files outside any class folder and entries that are not regular files
    (broken links, sockets) are returned as ``(path, reason)`` so the build reports them.
    """
    classes = sorted(d.name for d in src.iterdir() if d.is_dir())
    if not classes:
        raise SourceError(f"{src} has no class sub-folders; expected SRC/<class>/<image files>")
    left_out = [(str(p), "not inside a class folder (expected SRC/<class>/<image files>)")
                for p in sorted(src.iterdir()) if not p.is_dir()]
    items = []
    for label, name in enumerate(classes):
        for path in sorted((src / name).rglob("*")):
            if path.is_file():
                items.append((path, label))
            elif path.is_symlink() and not path.exists():
                left_out.append((str(path), "broken symbolic link"))
            elif not path.is_dir():
                left_out.append((str(path), "not a regular file"))
    return items, classes, left_out


def scan_list_file(src: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """Items of a list file with ``path label`` lines (paths relative to the file's folder)."""
    items = []
    for lineno, line in enumerate(src.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        path_str, _, label_str = line.rpartition(" ")
        try:
            label = int(label_str)
        except ValueError:
            raise SourceError(f"{src}:{lineno}: expected `path label` with an integer label, got {line!r}") from None
        if not path_str or label < 0:
            raise SourceError(f"{src}:{lineno}: expected `path label` with label >= 0, got {line!r}")
        path = Path(path_str)
        items.append((path if path.is_absolute() else src.parent / path, label))
    if not items:
        raise SourceError(f"{src} lists no images")
    num_classes = max(label for _, label in items) + 1
    return items, [str(c) for c in range(num_classes)]


def _check_empty_classes(src: Path, classes: Sequence[str], counts: Sequence[int], report: WriteReport,
                        allow: bool) -> None:
    """Refuse (SourceError) or, if ``allow``, warn about class folders of ``src`` that hold 0 records.

    ``counts`` are records per class; ``report.skipped`` says why a folder's files were not stored.
    """
    empty = []
    for name, count in zip(classes, counts):
        if count:
            continue
        folder = src / name
        skipped = [(p, r) for p, r in report.skipped if Path(p).is_relative_to(folder)]
        why = "no files" if not skipped else f"{len(skipped)} file(s), none stored: " + "; ".join(
            f"{Path(p).relative_to(folder)}: {r}" for p, r in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        empty.append((name, f"{folder} ({why})"))
    if not empty:
        return
    if not allow:
        raise SourceError(
            f"{len(empty)} class folder(s) hold no image that can be stored, and each would become a class with 0 "
            f"records (a label no record has): {'; '.join(text for _, text in empty)}. Remove the folder(s) from {src} "
            "(or put images in them), or pass --allow-empty-classes (allow_empty_classes=True) to keep each as a "
            "class with 0 records")
    for name, text in empty:
        report.warnings.append(f"class {name!r} has 0 records, kept as label {list(classes).index(name)} "
                               f"(--allow-empty-classes): {text}")


def _image_record(path: Path, label: int) -> Callable[[], Mapping[str, Any]]:
    return lambda: {"image": path.read_bytes(), "label": label}


def jsonl_records(src: Path, image_fields: Sequence[str]) -> Iterator[tuple[str, Callable[[], Mapping[str, Any]]]]:
    """``(FILE:LINE, load)`` per non-empty line; ``load`` parses it and reads its image files."""
    with open(src) as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue

            def load(line: str = line, lineno: int = lineno) -> Mapping[str, Any]:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not a JSON object ({exc.msg} at column {exc.colno})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                for name in image_fields:
                    if not isinstance(record.get(name), str):
                        raise ValueError(f"field {name!r} must be an image path, got {record.get(name)!r}")
                    path = Path(record[name])
                    record[name] = (path if path.is_absolute() else src.parent / path).read_bytes()
                return record

            yield f"{src}:{lineno}", load


def build_lmdb(
    src: str | os.PathLike,
    out: str | os.PathLike,
    overwrite: bool = False,
    threads: int | None = None,
    progress: bool = True,
    jsonl: bool = False,
    image_fields: Sequence[str] = ("image",),
    task: str = "",
    allow_empty_classes: bool = False,
    shard_bytes: int | None = None,
    source_format: str = "files",
    storage_options: Mapping[str, Any] | None = None,
    tfrecord_keys: tuple[str, str] = ("image/encoded", "image/class/label"),
) -> WriteReport:
    """Build ``out`` from a folder, list file or (``jsonl``) JSON-lines file ``src``; see the module doc.

    With ``progress``, every file or line left out is printed as it is found; the returned report lists
    them all either way. SourceError names each class folder with no image that can be stored, unless
    ``allow_empty_classes`` (then each is a class with 0 records and a warning in the report). ``shard_bytes``:
    write a sharded dataset (``sharded_writer.py``) of shards of about that size instead of one LMDB, a folder's
    or list's files in a seeded shuffled order (``SHARD_ORDER_SEED``), so each shard is a random sample.
    ``source_format="webdataset"``: ``src`` is WebDataset tar shards (a tar, a folder of them, or an fsspec URL or
    glob, ``webdataset.py``), classes ``"0"`` ... up to the largest label; ``"tfrecord"``: TFRecord files of
    ``tf.train.Example`` (``tfrecord.py``; ``tfrecord_keys``: the image and label features' names), the same way.
    """
    if source_format in ("webdataset", "tfrecord"):
        return _build_from_stream(source_format, str(src), out, overwrite, threads, progress, task, shard_bytes,
                                  dict(storage_options or {}), tfrecord_keys)
    src = Path(src)
    threads = threads or os.cpu_count() or 1
    classes: list[str] = []
    report = WriteReport()
    # Known before any record is read: a broken first file must not decide that images are plain bytes.
    kinds: dict[str, str] = {name: "image" for name in image_fields}
    if jsonl:
        if not src.is_file():
            raise SourceError(f"{src} does not exist; --jsonl expects a file of JSON objects, one per line")
        if shard_bytes:
            report.warnings.append("records go into shards in the order of the file's lines: shuffle the lines first "
                                   "if they run by class, or each shard (and each batch of an elastic pool, whose "
                                   "epochs shuffle shard by shard) holds few classes")
        items: Iterator[tuple[str, Callable[[], Mapping[str, Any]]]] = jsonl_records(src, image_fields)
        total = None
    else:
        if src.is_dir():
            paths, classes, left_out = scan_folder(src)
            report.skipped.extend(left_out)
        elif src.is_file():
            paths, classes = scan_list_file(src)
        else:
            raise SourceError(f"{src} does not exist; pass an image folder, a `path label` list file or --jsonl FILE")
        if not paths:
            raise SourceError(f"{src} holds no files in its class folders")
        if src.is_dir() and not allow_empty_classes:  # folders without a file: refused before any image is read
            files = Counter(label for _, label in paths)
            _check_empty_classes(src, classes, [files[label] for label in range(len(classes))], report, allow=False)
        for position, reason in report.skipped if progress else ():
            tqdm.write(f"skipped {position}: {reason}")
        if shard_bytes:  # shards are random samples, not class runs: an epoch shuffles shard by shard
            paths = [paths[i] for i in np.random.default_rng(SHARD_ORDER_SEED).permutation(len(paths))]
        items = ((str(path), _image_record(path, label)) for path, label in paths)
        total = len(paths)
        task = task or "classification"
    # A folder or list build knows its whole schema; JSON lines know which fields are images.
    schema = None if jsonl else {"image": "image", "label": "int"}
    with open_writer(out, shard_bytes, classes, overwrite=overwrite, schema=schema, kinds=kinds) as writer:
        write_records(writer, items, report, threads, progress, total, check_images=True,
                      label_classes=len(classes))
        if src.is_dir() and not jsonl:  # folders whose every file was skipped: refused before anything is published
            _check_empty_classes(src, classes, [writer.label_counts[label] for label in range(len(classes))], report,
                                allow_empty_classes)
        report.meta = writer.finish(classes=classes, task=task)
    return report


def _build_from_stream(source_format: str, src: str, out: str | os.PathLike, overwrite: bool, threads: int | None,
                       progress: bool, task: str, shard_bytes: int | None, storage_options: dict[str, Any],
                       tfrecord_keys: tuple[str, str]) -> WriteReport:
    """A build from records read as a stream (WebDataset tars, TFRecord files): classes "0" ... the largest label."""
    if source_format == "webdataset":
        from stoker.producer.dataset.build.webdataset_import import webdataset_items

        items = webdataset_items([src], storage_options)
    else:
        from stoker.producer.dataset.build.tfrecord_import import tfrecord_items

        items = tfrecord_items([src], storage_options, *tfrecord_keys)
    report = WriteReport()
    try:
        first = next(items)
    except (OSError, ValueError) as exc:
        raise SourceError(f"{src}: {exc}") from None
    except StopIteration:
        raise SourceError(f"{src} holds no sample") from None
    with open_writer(out, shard_bytes, overwrite=overwrite, schema={"image": "image", "label": "int"}) as writer:
        write_records(writer, itertools.chain([first], items), report, threads or os.cpu_count() or 1, progress,
                      None, check_images=True)
        labels = writer.label_counts
        classes = [str(c) for c in range(max(labels) + 1)] if labels else []
        report.meta = writer.finish(classes=classes, task=task or "classification")
    return report
