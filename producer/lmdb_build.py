"""Build a Stoker LMDB from an image folder (one sub-folder per class) or a list file.

Every file is checked before it is stored, by content, not by file name: it must
be an image the producers decode (``image_decode``: JPEG, PNG, WebP, BMP, GIF,
TIFF), within the pixel limit (read from the header, so a decompression bomb is
refused without decoding it), decode with the producers' own decoder, and (for
JPEG) carry its end-of-image marker. Nothing is lost silently: every file that is
not stored (not an image, too large, corrupt, unreadable, a broken link, outside
any class folder) is reported by path with the reason, and counted; the build
still publishes the good ones. Checks run on a thread pool (the decoders release
the GIL).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from tqdm import tqdm

from .dataset_format import DatasetMeta
from .dataset_writer import DatasetWriter
from .image_decode import DecodeError, decode_rgb, read_image_info, sniff_format


class SourceError(ValueError):
    """The build source (folder or list file) cannot be used; the message says why."""


@dataclass
class BuildReport:
    """What a build did: records written, files skipped with the reason for each."""

    meta: DatasetMeta | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)


def check_encoded_image(data: bytes) -> str | None:
    """Return None if a producer can decode ``data``, else the reason it cannot (see the module doc)."""
    if sniff_format(data) == "jpeg" and data.rfind(b"\xff\xd9") < 0:
        return "truncated JPEG (no end-of-image marker)"
    try:
        decode_rgb(data, info=read_image_info(data))
    except DecodeError as exc:
        return str(exc)
    return None


def scan_folder(src: Path) -> tuple[list[tuple[Path, int]], list[str], list[tuple[str, str]]]:
    """Items, class names and what was left out of an ImageNet-train-style folder (sorted, deterministic).

    Every regular file under a class folder is an item, whatever its name: its content decides
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


def _load_and_check(path: Path) -> tuple[bytes | None, str | None]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    reason = check_encoded_image(data)
    return (None, reason) if reason else (data, None)


def _checked(items: Sequence[tuple[Path, int]], threads: int) -> Iterator[tuple[Path, int, bytes | None, str | None]]:
    """Items with their bytes (or the reason they are unusable), in source order (deterministic indices).

    At most ``4 * threads`` files are read ahead, so memory stays bounded however many there are.
    """
    window = 4 * threads
    with ThreadPoolExecutor(max_workers=threads) as pool:
        pending: deque = deque()
        for path, label in items:
            pending.append((path, label, pool.submit(_load_and_check, path)))
            if len(pending) >= window:
                done_path, done_label, future = pending.popleft()
                yield done_path, done_label, *future.result()
        while pending:
            done_path, done_label, future = pending.popleft()
            yield done_path, done_label, *future.result()


def build_lmdb(
    src: str | os.PathLike,
    out: str | os.PathLike,
    overwrite: bool = False,
    threads: int | None = None,
    progress: bool = True,
) -> BuildReport:
    """Build ``out`` from folder or list file ``src``; see the module doc for checks."""
    src = Path(src)
    left_out: list[tuple[str, str]] = []
    if src.is_dir():
        items, classes, left_out = scan_folder(src)
    elif src.is_file():
        items, classes = scan_list_file(src)
    else:
        raise SourceError(f"{src} does not exist; pass an image folder or a `path label` list file")
    if not items:
        raise SourceError(f"{src} holds no files in its class folders")
    report = BuildReport(skipped=list(left_out))
    with DatasetWriter(out, overwrite=overwrite) as writer:
        bar = tqdm(total=len(items), desc="build", unit="img", disable=not progress)
        for path, label, data, reason in _checked(items, threads or os.cpu_count() or 1):
            if data is None:
                report.skipped.append((str(path), reason or "unknown"))
                bar.write(f"skipped {path}: {reason}")
            else:
                writer.add(label, data)
            bar.update(1)
        bar.close()
        report.meta = writer.finish(classes)
    return report
