"""``stoker data index --webdataset``: an index (a manifest with ``"shard_format": "tar"``) of WebDataset tars left
where they are, local or at any fsspec URL.

``index_webdataset(urls)`` expands each argument (brace lists as webdataset writes them, ``{000000..000123}`` or
``{a,b}``, at most ``MAX_SHARDS`` names; then globs; a local folder means its ``*.tar``), streams each tar once
(``sources/webdataset/headers.StreamBlocks``: the same bounded header walk a reader runs, every byte hashed) and
records per tar its size, SHA-256 and whole samples. The dataset's fields are the extensions every sample has
(``sources/webdataset/fields``); one only some samples have is left out, named and counted in the manifest's
``info`` (``partial_fields``) and on stderr, since as a field it would cost every sample without it (``fields=``
keeps it anyway: a reader then names each sample without it); with ``.cls`` members, classes ``"0"``..``"max"`` and their counts. ``root`` is the folder (or URL) common to
every tar and shard names are paths under it. What the walk passed over is counted and its first reasons kept in
the manifest's ``info``, never dropped silently.

Every in-place index (these tars, ``parquet_index.py``'s files) is rooted by ``index_root`` and written by
``write_index``, whole or not at all.
"""

from __future__ import annotations

import posixpath
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import MAX_SHARDS, Manifest, ShardInfo, parse_manifest
from stoker.producer.dataset.sources.webdataset.fields import MAX_LABEL_BYTES, field_of, label_value
from stoker.producer.dataset.sources.webdataset.headers import MAX_PROBLEMS, StreamBlocks, TarWalk
from stoker.producer.dataset.sources.webdataset.samples import SampleBuilder

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")
CHUNK = 8 << 20


def expand_braces(pattern: str, limit: int = MAX_SHARDS) -> list[str]:
    """``pattern`` with every ``{first..last}`` (zero-padded to ``first``'s width) and ``{a,b,c}`` expanded, in
    order; DatasetError if it would make more than ``limit`` names (counted before any is made)."""
    parts, choices, at = [], [], 0
    for match in _BRACE.finditer(pattern):
        parts.append(pattern[at:match.start()])
        body, span = match.group(1), _RANGE.fullmatch(match.group(1))
        if span:
            first, last = int(span.group(1)), int(span.group(2))
            if last < first or last - first >= limit:
                raise DatasetError(f"{pattern}: range {{{body}}} is empty or names more than {limit} shards")
            choices.append((first, last, len(span.group(1))))
        else:
            choices.append(tuple(body.split(",")))
        at = match.end()
    parts.append(pattern[at:])
    total = 1
    for choice in choices:
        total *= choice[1] - choice[0] + 1 if isinstance(choice[0], int) else len(choice)
        if total > limit:
            raise DatasetError(f"{pattern}: names more than {limit} shards (the most one index holds)")
    names = [parts[0]]
    for part, choice in zip(parts[1:], choices):
        options = ([str(n).zfill(choice[2]) for n in range(choice[0], choice[1] + 1)]  # type: ignore[misc]
                   if isinstance(choice[0], int) else list(choice))
        names = [name + option + part for name in names for option in options]
    return names


def _tars(urls: Sequence[str], storage_options: Optional[dict[str, Any]]) -> tuple[Any, list[str]]:
    """The file system and the sorted, distinct tar paths ``urls`` name; DatasetError if they name none or mix
    file systems."""
    import fsspec

    fs, found = None, set()
    for url in urls:
        for name in expand_braces(url):
            here, path = fsspec.core.url_to_fs(name, **(storage_options or {}))
            if fs is not None and here.protocol != fs.protocol:
                raise DatasetError(f"{url}: one index holds tars of one file system ({fs.protocol} and {here.protocol})")
            fs = here
            if any(c in path for c in "*?["):
                found.update(fs.glob(path))
            elif fs.isdir(path):
                found.update(fs.glob(path.rstrip("/") + "/*.tar"))
            elif fs.exists(path):
                found.add(path)
            else:
                raise DatasetError(f"{name}: no such tar")
            if len(found) > MAX_SHARDS:
                raise DatasetError(f"{url}: more than {MAX_SHARDS} tars (the most one index holds)")
    if fs is None or not found:
        raise DatasetError(f"{' '.join(urls)[:200]}: no tar there (give tars, a folder of them, a glob or a brace list)")
    return fs, sorted(found)


def is_local(fs: Any) -> bool:
    """Whether the fsspec file system ``fs`` is this machine's own."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"file", "local"} & set(protocols))


def index_root(fs: Any, paths: Sequence[str]) -> tuple[str, list[str]]:
    """The root of an index of the files ``paths`` on ``fs`` (their common folder: an absolute local path, or a URL)
    and each file's shard name, its path under that root. Every in-place index (tars, Parquet) roots its files so."""
    folder = posixpath.commonpath([posixpath.dirname(p) or "/" for p in paths])
    names = [posixpath.relpath(p, folder) for p in paths]
    return (folder if is_local(fs) else fs.unstrip_protocol(folder)), names


def write_index(manifest: Manifest, destination: str, storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """``manifest``'s JSON written to ``destination`` (a path or fsspec URL), whole or not at all where the storage
    allows: a local file is written beside (``DESTINATION.partial``) and renamed over; an object store's put is
    whole by itself. OSError from the storage passes through."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(destination, **dict(storage_options or {}))
    text = manifest.to_json().encode()
    if is_local(fs):
        partial = Path(f"{path}.partial")
        partial.write_bytes(text)
        partial.replace(path)
    else:
        with fs.open(path, "wb") as f:
            f.write(text)


def index_tar_stream(stream: Any, where: str) -> dict[str, Any]:
    """One tar read once from ``stream``: bytes, sha256, samples, extensions seen, labels (per sample with a
    valid .cls; ``bad_labels`` counted), members passed over and why the walk ended early ("" if it did not)."""
    blocks = StreamBlocks(stream, CHUNK)
    walk = TarWalk(blocks, where)
    builder = SampleBuilder(walk.skip)
    labels: Counter[int] = Counter()
    bad_labels = 0
    for name, offset, size in walk.members():
        key, extension = builder.add(name, offset, size)
        if extension == b"cls":  # the only bodies the index reads: a few bytes each, for the classes
            try:
                labels[label_value(blocks.take(size) if size <= MAX_LABEL_BYTES else b"-")] += 1
            except ValueError:
                bad_labels += 1
    index = builder.finish(whole=not walk.ended, cut=walk.cut)
    blocks.drain()
    return {"bytes": blocks.pos, "sha256": blocks.sha256.hexdigest(), "records": len(index),
            "extensions": index.extension_counts(), "labels": labels, "bad_labels": bad_labels,
            "skipped": walk.skipped, "problems": walk.problems, "ended": walk.ended}


def index_webdataset(urls: Sequence[str], storage_options: Optional[dict[str, Any]] = None, progress: bool = True,
                     fields: Optional[Sequence[str]] = None) -> Manifest:
    """The index of the tars ``urls`` name (module doc), checked as any manifest is; ``fields``: keep only these
    (default: every field seen). DatasetError if the tars hold no sample, name no tar, or a kept field is unseen.
    Progress and what was passed over go to stderr when ``progress``."""
    fs, paths = _tars(urls, storage_options)
    root, names = index_root(fs, paths)
    shards, kinds, labels, bad_labels, skipped, problems = [], {}, Counter(), 0, 0, []
    having: Counter[str] = Counter()  # field -> samples that have it
    started = time.monotonic()
    for number, (path, name) in enumerate(zip(paths, names)):
        with fs.open(path, "rb") as stream:
            tar = index_tar_stream(stream, name)
        shards.append({"name": name, "records": tar["records"], "bytes": tar["bytes"], "sha256": tar["sha256"]})
        for extension, samples in tar["extensions"].items():
            field, kind = field_of(extension)
            kinds[field] = kind
            having[field] += samples
        labels.update(tar["labels"])
        bad_labels += tar["bad_labels"]
        skipped += tar["skipped"] + bool(tar["ended"])
        problems += [p for p in [tar["ended"], *tar["problems"]] if p][:MAX_PROBLEMS - len(problems)]
        if progress:
            done = sum(s["bytes"] for s in shards) / 1e6
            print(f"[{number + 1}/{len(paths)}] {name}: {tar['records']} samples, {tar['bytes'] / 1e6:.1f} MB "
                  f"({done / max(time.monotonic() - started, 1e-9):.0f} MB/s){'; ' + tar['ended'] if tar['ended'] else ''}",
                  file=sys.stderr)
    count = sum(s["records"] for s in shards)
    partial = {name: having[name] for name in kinds if having[name] < count}
    if fields is not None:
        unseen = sorted(set(fields) - set(kinds))
        if unseen:
            raise DatasetError(f"fields {unseen} are in no tar: the fields seen are {sorted(kinds)}")
        kinds = {f: kinds[f] for f in fields}
    else:
        kinds = {name: kind for name, kind in kinds.items() if name not in partial}
        if partial and progress:
            print(f"left out fields only some of the {count} samples have: "
                  f"{', '.join(f'{n} ({k})' for n, k in sorted(partial.items()))}; --fields keeps one (then each "
                  "sample without it is skipped, named)", file=sys.stderr)
    if not count or not kinds:
        raise DatasetError(f"{root}: the tars hold no whole sample with a field ({skipped} members passed over: "
                           f"{'; '.join(problems[:3])})")
    labelled = "label" in kinds
    classes = [str(c) for c in range(max(labels) + 1)] if labelled and labels else []
    counts = [labels[c] for c in range(len(classes))] if classes and sum(labels.values()) == count else None
    meta = DatasetMeta(count=count, fields={n: FieldKind(k) for n, k in kinds.items()}, classes=tuple(classes),
                       task="classification" if classes else "",
                       info={"source": "webdataset", "partial_fields": partial, "skipped_members": skipped, "bad_labels": bad_labels,
                             "problems": problems}, class_counts=tuple(counts) if counts is not None else None)
    infos, first = [], 0
    for s in shards:
        infos.append(ShardInfo(s["name"], first, s["records"], s["bytes"], s["sha256"]))
        first += s["records"]
    return parse_manifest(Manifest(meta, tuple(infos), "tar", root).to_json().encode(), f"the index of {root}")
