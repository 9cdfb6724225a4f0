"""Sharded datasets: N Stoker LMDBs and a manifest, read as one dataset with global record indices.

Layout (docs/format.md, "Sharded datasets")::

    DATASET/manifest.json          {"format": "stoker-shards", "version": 1, "count": N, "fields": ..., "shards": [...]}
    DATASET/shard-00000/data.mdb   records 0 .. n0-1 of the dataset, keys 0 .. n0-1 (a valid one-shard dataset)
    DATASET/shard-00001/data.mdb   records n0 .. n0+n1-1, keys 0 .. n1-1

Each shard is an ordinary Stoker LMDB (``stoker lmdb info`` reads it alone); the manifest lists every shard's
name, record count, size in bytes and SHA-256 of its ``data.mdb``, so a reader that fetched a shard from object
storage can check it before use, and the dataset's schema and classes. A record's global index is its shard's
first index plus its key in the shard. One plain LMDB stays a valid dataset: ``open_dataset`` opens either.

``ShardedDataset`` reads a sharded dataset whose shards a ``ShardSource`` makes local (a folder: they are there;
object storage: ``remote.ShardCache`` fetches them). Validation: a manifest that does not describe a dataset
(counts that do not add up, names outside ``shard-NNNNN``, more than ``MAX_SHARDS``) is a DatasetError naming
what is wrong; a shard that cannot be had is a RecordError for each of its records (the producer skips and counts
them, naming the shard), never a crash.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence

from stoker.producer.dataset.format import (DatasetError, DatasetMeta, FieldKind, LmdbDataset, RecordError,
                                            record_key)

MANIFEST = "manifest.json"
FORMAT = "stoker-shards"
VERSION = 1
MAX_SHARDS = 100_000
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
OPEN_SHARDS = 16  # LMDB environments a reader keeps open at once (least recently used closed first)
CHECK_EVICTED_S = 0.5  # how often a reader checks an open shard of a bounded cache is still there
_SHARD_NAME = re.compile(r"shard-[0-9]{5,6}")  # fullmatch: no trailing newline, ASCII digits only
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ShardInfo:
    name: str
    first: int  # global index of its first record
    records: int
    bytes: int  # size of its data.mdb
    sha256: str


@dataclass(frozen=True)
class Manifest:
    meta: DatasetMeta  # the whole dataset's: count, fields, classes, per-class counts
    shards: tuple[ShardInfo, ...]

    def shard_of(self, index: int) -> int:
        """The shard holding global record ``index``."""
        if not 0 <= index < self.meta.count:
            raise IndexError(f"record {index} is outside the dataset's {self.meta.count}")
        return bisect.bisect_right(self._firsts, index) - 1

    @cached_property
    def records_per_shard(self) -> int:
        """The records every shard holds (the last may hold fewer), 0 if they differ: an elastic pool's epochs are
        two-level shuffles (shards, then records within them) only over such a layout, which is one number."""
        first = self.shards[0].records
        if len(self.shards) < 2 or any(s.records != first for s in self.shards[:-1]) or self.shards[-1].records > first:
            return 0
        return first

    @cached_property
    def _firsts(self) -> list[int]:
        return [s.first for s in self.shards]

    def to_json(self) -> str:
        m = self.meta
        return json.dumps({"format": FORMAT, "version": VERSION, "count": m.count,
                           "fields": {n: k.to_meta() for n, k in m.fields.items()}, "classes": list(m.classes),
                           "class_counts": list(m.class_counts) if m.class_counts is not None else None,
                           "task": m.task, "info": dict(m.info),
                           "shards": [{"name": s.name, "records": s.records, "bytes": s.bytes, "sha256": s.sha256}
                                      for s in self.shards]}, indent=1)


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
    if body.get("version") != VERSION:
        raise bad(f"version {body.get('version')!r}; this Stoker reads version {VERSION}: upgrade it")
    shards, count = body.get("shards"), body.get("count")
    if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_SHARDS:
        raise bad(f"'shards' must list 1-{MAX_SHARDS} shards")
    infos, first = [], 0
    for i, s in enumerate(shards):
        ok = (isinstance(s, dict) and isinstance(s.get("name"), str) and _SHARD_NAME.fullmatch(s["name"])
              and all(isinstance(s.get(k), int) and not isinstance(s.get(k), bool) and s[k] >= 0
                      for k in ("records", "bytes"))
              and isinstance(s.get("sha256"), str) and _SHA256.fullmatch(s["sha256"]))
        if not ok:
            raise bad(f"shard {i} must be {{name: shard-NNNNN, records: int, bytes: int, sha256: hex}}")
        infos.append(ShardInfo(s["name"], first, s["records"], s["bytes"], s["sha256"]))
        first += s["records"]
    if len({s.name for s in infos}) != len(infos):
        raise bad("two shards have one name")
    if not isinstance(count, int) or isinstance(count, bool) or count != first or not 0 < count < 10**8:
        raise bad(f"'count' {count!r} is not the shards' records added up ({first}), 1 to 10^8")
    meta = _meta(body, count, bad)
    return Manifest(meta, tuple(infos))


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


class ShardSource(Protocol):
    """Where a sharded dataset's shards are: ``local(shard)`` is the folder holding its ``data.mdb`` (fetched first
    where needed; RecordError-worthy failures raise ``ShardUnavailable``). ``evicts``: a shard's folder may be
    removed while a reader has it open (a bounded cache): the reader then lets go of it and asks again;
    ``holdings(shards)``: an evicting source's capacity and cached shards (``ShardedDataset.holdings``);
    ``prefetch(shards, number)``: fetch one ahead, in the background."""

    evicts: bool

    def local(self, shard: ShardInfo) -> Path: ...

    def holdings(self, shards: Sequence[ShardInfo]) -> tuple[int, list[int]]: ...

    def prefetch(self, shards: Sequence[ShardInfo], number: int) -> None: ...


class ShardUnavailable(RuntimeError):
    """A shard cannot be had (missing, corrupt, unreachable past the retries): its records are skipped."""


class LocalShards:
    """Shards in a folder beside the manifest."""

    evicts = False

    def __init__(self, root: Path) -> None:
        self.root = root

    def local(self, shard: ShardInfo) -> Path:
        path = self.root / shard.name
        if not (path / "data.mdb").is_file():
            raise ShardUnavailable(f"shard {shard.name} is missing: no {path / 'data.mdb'}")
        return path


class ShardedDataset:
    """``LmdbDataset``'s interface over a sharded dataset (module doc). One per process, like LmdbDataset."""

    def __init__(self, manifest: Manifest, source: ShardSource, where: str, manifest_bytes: bytes = b"") -> None:
        self.manifest, self.source, self.path = manifest, source, where
        self.manifest_bytes = manifest_bytes  # as read: the daemon pins its workers to it (RemoteOptions.manifest)
        self.meta = manifest.meta
        self._open: OrderedDict[int, LmdbDataset] = OrderedDict()
        self._checked: dict[int, float] = {}  # shard -> when its open file was last seen in place
        self._inode: dict[int, int] = {}  # shard -> the inode of the data.mdb it opened (a re-fetch is another)

    def __len__(self) -> int:
        return self.meta.count

    def _shard(self, number: int) -> LmdbDataset:
        if number in self._open:
            dataset = self._open[number]
            if not self._evicted(number, dataset):
                self._open.move_to_end(number)
                return dataset
            self._close(number)
        if self.source.evicts:  # opening another: let go of every open shard that left the cache meanwhile
            for other in [n for n, d in self._open.items() if self._evicted(n, d, now=float("inf"))]:
                self._close(other)
        info = self.manifest.shards[number]
        for attempt in range(3):
            try:
                path = self.source.local(info)
                dataset = LmdbDataset(path)
                break
            except DatasetError as exc:
                # Another worker evicted the shard between its fetch and our open: fetch it again.
                if not self.source.evicts or (path / "data.mdb").exists() or attempt == 2:
                    raise RecordError(record_key(info.first), f"shard {info.name}: {exc}") from None
            except ShardUnavailable as exc:
                raise RecordError(record_key(info.first), f"shard {info.name}: {exc}") from None
        if len(dataset) != info.records:
            dataset.close()
            raise RecordError(record_key(info.first), f"shard {info.name} holds {len(dataset)} records, the manifest "
                              f"says {info.records}: rebuild the dataset or fix the manifest")
        self._open[number] = dataset
        if self.source.evicts:
            self._inode[number] = os.stat(dataset.path / "data.mdb").st_ino
        while len(self._open) > OPEN_SHARDS:
            self._close(next(iter(self._open)))
        return dataset

    def _close(self, number: int) -> None:
        self._open.pop(number).close()
        self._checked.pop(number, None)
        self._inode.pop(number, None)

    def _evicted(self, number: int, dataset: LmdbDataset, now: Optional[float] = None) -> bool:
        """Whether an open shard's file left a bounded cache (gone, or fetched again: another file). Held open, an
        evicted (unlinked) shard would keep its disk space past the budget and never be fetched again; looked at
        most every CHECK_EVICTED_S (``now=inf``: at once). A shard still in place is marked recently used."""
        clock = time.monotonic()
        if not self.source.evicts or (now or clock) - self._checked.get(number, 0.0) < CHECK_EVICTED_S:
            return False
        self._checked[number] = clock
        try:
            if os.stat(dataset.path / "data.mdb").st_ino != self._inode.get(number):
                return True
            os.utime(dataset.path)  # in use: the cache evicts least recently used folders first
        except OSError:
            return True
        return False

    def read(self, index: int) -> dict[str, Any]:
        """Record ``index`` (global); RecordError if it is corrupt or its shard cannot be had."""
        number = self.manifest.shard_of(index)
        return self._shard(number).read(index - self.manifest.shards[number].first)

    def iter_raw(self, indices: list[int]) -> Iterator[tuple[int, Optional[bytes]]]:
        for index in indices:
            number = self.manifest.shard_of(index)
            local = index - self.manifest.shards[number].first
            for _, raw in self._shard(number).iter_raw([local]):
                yield index, raw

    def size_bytes(self) -> int:
        return sum(s.bytes for s in self.manifest.shards)

    def prefetch(self, number: int) -> None:
        """Fetch shard ``number`` ahead, in the background, where the source is a cache (a hint: an error is the
        read's to report when it comes to that shard)."""
        if self.source.evicts:
            self.source.prefetch(self.manifest.shards, number)

    def holdings(self) -> tuple[Optional[int], list[int]]:
        """``(capacity, held)``: how many shards this host's cache holds at most (None: every shard is on local
        disk) and which it holds now, least recently used first (at most ``MAX_HELD``). What an elastic pool's
        trainer hands splits by (protocol ``status``: ``cache``, ``held``); reads no shard."""
        if not self.source.evicts:
            return None, []
        return self.source.holdings(self.manifest.shards)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()

    def __enter__(self) -> "ShardedDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class RemoteOptions:
    """How a producer reaches a dataset in object storage (``stoker produce``'s flags); plain data, so it crosses
    ``spawn`` to the workers. ``storage_options``: fsspec's, as text (``true``/``false`` become booleans)."""

    cache_dir: Optional[str] = None
    cache_bytes: Optional[int] = None
    storage_options: tuple[tuple[str, str], ...] = ()
    s3_endpoint: Optional[str] = None
    retry_seconds: float = 300.0
    #: the manifest as the daemon read it, given to its workers: a dataset re-uploaded during a run never changes
    #: what a worker's record index means (None: read it)
    manifest: Optional[bytes] = None

    def fsspec_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in self.storage_options}
        if self.s3_endpoint:
            options.setdefault("client_kwargs", {})["endpoint_url"] = self.s3_endpoint
        return options

    def open_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"storage_options": self.fsspec_options(), "retry_seconds": self.retry_seconds,
                                  "manifest": self.manifest}
        if self.cache_dir:
            kwargs["cache_dir"] = self.cache_dir
        if self.cache_bytes:
            kwargs["cache_bytes"] = self.cache_bytes
        return kwargs


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names object storage (``s3://``, ``gs://``, ``file://``: any fsspec URL)."""
    return "://" in str(location)


def open_dataset(location: str | os.PathLike, remote: Optional[RemoteOptions] = None,
                 cancel: Optional[threading.Event] = None) -> "LmdbDataset | ShardedDataset":
    """A dataset at a path (one LMDB, or a sharded dataset's folder) or a URL (a sharded dataset in object
    storage, reached with ``remote``; ``cancel``, once set, ends its waits on storage: ``remote.open_remote``).
    DatasetError naming what is wrong."""
    if is_url(location):
        from stoker.producer.dataset.remote import open_remote

        return open_remote(str(location), cancel=cancel, **(remote or RemoteOptions()).open_kwargs())
    path = Path(location)
    if (path / MANIFEST).is_file():
        data = remote.manifest if remote is not None and remote.manifest else (path / MANIFEST).read_bytes()
        return ShardedDataset(parse_manifest(data, str(path / MANIFEST)), LocalShards(path), str(path), data)
    return LmdbDataset(path)
