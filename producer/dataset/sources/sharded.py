"""Sharded datasets: a manifest and N shards of one format (Stoker LMDBs, WebDataset tars, Parquet files), read as
one dataset with global record indices.

Layout (docs/format.md, "Sharded datasets")::

    DATASET/manifest.json          {"format": "stoker-shards", "version": 1, "count": N, "fields": ..., "shards": [...]}
    DATASET/shard-00000/data.mdb   records 0 .. n0-1 of the dataset, keys 0 .. n0-1 (a valid one-shard dataset)
    DATASET/shard-00001/data.mdb   records n0 .. n0+n1-1, keys 0 .. n1-1

Each LMDB shard is an ordinary Stoker LMDB (``stoker lmdb info`` reads it alone); the manifest lists every shard's
name, record count, size in bytes and SHA-256 of its one object, so a reader that fetched a shard from object
storage can check it before use, and the dataset's schema and classes (``manifest.py``). A record's global index is
its shard's first index plus its index in the shard. One plain LMDB stays a valid dataset: ``open_dataset`` (this
package's door) opens either. A manifest's ``shard_format`` names how a shard object is named and opened (a
``ShardFormat``, ``shard_format.py``); its ``root`` where the objects are.

``ShardedDataset`` reads a sharded dataset whose shards a ``ShardSource`` makes local (a folder: they are there;
object storage: ``shard_cache.ShardCache`` fetches them), each opened by its format. A shard that cannot be had is
a RecordError for each of its records (the producer skips and counts them, naming the shard), never a crash.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

from stoker.producer.dataset.sources.lmdb_format import DatasetError, RecordError, record_key
from stoker.producer.dataset.sources.manifest import Manifest, ShardInfo
from stoker.producer.dataset.sources.shard_format import ShardFormat, ShardReader, shard_format as registered_format

OPEN_SHARDS = 16  # shard readers a reader keeps open at once (least recently used closed first)
CHECK_EVICTED_S = 0.5  # how often a reader checks an open shard of a bounded cache is still there
# How long a shard its format refused (corrupt, or not the manifest's count) is refused again without being opened:
# a cut 10,000-sample tar takes ~0.2 s to walk, once a record it would cost a worker half an hour an epoch.
REFUSED_HOLD_S = 30.0


class ShardSource(Protocol):
    """Where a sharded dataset's shards are: ``local(shard)`` is the path of its local file (an LMDB shard's
    ``data.mdb``; fetched first where needed; RecordError-worthy failures raise ``ShardUnavailable``). ``evicts``:
    a shard's file (and its folder) may be removed while a reader has it open (a bounded cache): the reader then
    lets go of it and asks again;
    ``holdings(shards)``: an evicting source's capacity and cached shards (``ShardedDataset.holdings``);
    ``prefetch(shards, number)``: fetch one ahead, in the background; ``index_file(shard)``: where a format that
    derives an index from a shard (``keeps_index``: a tar's samples) may keep it for the next process, or None;
    ``close()``: end what it runs in the background (a cache's fetch-ahead thread)."""

    evicts: bool

    def local(self, shard: ShardInfo) -> Path: ...

    def index_file(self, shard: ShardInfo) -> Optional[Path]: ...

    def holdings(self, shards: Sequence[ShardInfo]) -> tuple[int, list[int]]: ...

    def prefetch(self, shards: Sequence[ShardInfo], number: int) -> None: ...

    def close(self) -> None: ...


class ShardUnavailable(RuntimeError):
    """A shard cannot be had (missing, corrupt, unreachable past the retries): its records are skipped."""


class LocalShards:
    """Shards on local disk: under ``root`` (the manifest's folder, or its ``root``), each at its format's
    ``object_name``. Their derived indexes are kept under ``index_dir`` (``<sha256>.index``; created on first use),
    never beside the data (read in place, maybe a read-only folder); None: not kept."""

    evicts = False

    def __init__(self, root: Path, shard_format: ShardFormat, index_dir: Optional[Path] = None) -> None:
        self.root, self.format, self.index_dir = root, shard_format, index_dir

    def index_file(self, shard: ShardInfo) -> Optional[Path]:
        if self.index_dir is None:
            return None
        try:
            self.index_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None  # not writable: an index that cannot be kept is built at each open (the reader logs it)
        return self.index_dir / f"{shard.sha256}.index"

    def local(self, shard: ShardInfo) -> Path:
        path = self.root / self.format.object_name(shard.name)
        if not path.is_file():
            raise ShardUnavailable(f"shard {shard.name} is missing: no {path}")
        return path

    def close(self) -> None:
        pass  # nothing runs in the background


class ShardedDataset:
    """A ``record_source.RecordSource`` over a sharded dataset of any shard format (module doc). One per process,
    like LmdbDataset. ``shard_format``: the manifest's format as its ``source`` was made with, so a dataset has one
    (a Parquet format holds the dataset's decoded row groups); None: made here from the manifest. DatasetError at
    construction if the manifest's shard format cannot be read here."""

    def __init__(self, manifest: Manifest, source: ShardSource, where: str, manifest_bytes: bytes = b"",
                 shard_format: Optional[ShardFormat] = None) -> None:
        self.manifest, self.source, self.path = manifest, source, where
        #: as read (the JSON), or the compact form a worker was handed (RemoteOptions.manifest); b"": none
        self.manifest_bytes = manifest_bytes
        self.meta = manifest.meta
        self.format = shard_format if shard_format is not None else registered_format(manifest.shard_format)
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        self._checked: dict[int, float] = {}  # shard -> when its open file was last seen in place
        self._inode: dict[int, tuple[Path, int]] = {}  # shard -> (its file, the inode opened): a re-fetch is another
        self._refused: dict[int, tuple[float, str]] = {}  # shard -> when its format refused it, and why
        # The shard the last read was in: its first record, the record after its last, its number. A worker reads
        # shard by shard (shard-aware epochs), so most reads skip the manifest's search.
        self._last_span = (0, 0, -1)

    @property
    def layout(self) -> Manifest:
        """The shards and their record counts (``record_source.RecordSource.layout``)."""
        return self.manifest

    def __len__(self) -> int:
        return self.meta.count

    def _shard(self, number: int) -> ShardReader:
        if number in self._open:
            dataset = self._open[number]
            if not self._evicted(number):
                self._open.move_to_end(number)
                return dataset
            self._close(number)
        if self.source.evicts:  # opening another: let go of every open shard that left the cache meanwhile
            for other in [n for n in self._open if self._evicted(n, now=float("inf"))]:
                self._close(other)
        info = self.manifest.shards[number]
        refused = self._refused.get(number)
        if refused is not None and time.monotonic() - refused[0] < REFUSED_HOLD_S:
            raise RecordError(record_key(info.first), refused[1])  # a new one: a re-raised one grows its traceback
        dataset = self._open_local(number, info)
        if len(dataset) != info.records:
            dataset.close()
            raise self._refuse(number, info, f"shard {info.name} holds {len(dataset)} records, the manifest says "
                               f"{info.records}: rebuild the dataset or fix the manifest")
        self._open[number] = dataset
        while len(self._open) > OPEN_SHARDS:
            self._close(next(iter(self._open)))
        return dataset

    def _open_local(self, number: int, info: ShardInfo) -> ShardReader:
        """Shard ``number`` made local and opened; RecordError if it cannot be. In a bounded cache another worker
        may evict the shard between its fetch and our open, or while we open it: the file's inode is read before
        and after the open, and a shard gone or replaced meanwhile is let go of and asked for again (three times,
        then the budget is named too small)."""
        for _ in range(3):
            try:
                path = self.source.local(info)
            except ShardUnavailable as exc:
                raise RecordError(record_key(info.first), f"shard {info.name}: {exc}") from None
            try:
                before = os.stat(path).st_ino if self.source.evicts else 0
                if getattr(self.format, "keeps_index", False):
                    dataset = self.format.open(path, info, self.meta, self.source.index_file(info))  # type: ignore
                else:
                    dataset = self.format.open(path, info, self.meta)
            except (DatasetError, OSError) as exc:
                if self.source.evicts and not path.exists():
                    continue  # evicted before or while we opened it
                if isinstance(exc, OSError):  # may pass (EMFILE, EIO): asked again at the next record
                    raise RecordError(record_key(info.first), f"shard {info.name}: {exc}") from None
                raise self._refuse(number, info, f"shard {info.name}: {exc}") from None
            if not self.source.evicts:
                return dataset
            try:
                after = os.stat(path).st_ino
            except OSError:
                after = None
            if after == before:  # the file we opened is the one in the cache
                self._inode[number] = (path, before)
                return dataset
            dataset.close()
        raise RecordError(record_key(info.first), f"shard {info.name} was evicted from the cache three times as soon "
                          "as it was fetched: the cache budget is too small for the workers reading at once; raise "
                          "--cache-size")

    def _refuse(self, number: int, info: ShardInfo, why: str) -> RecordError:
        """The RecordError saying ``why``, remembered for REFUSED_HOLD_S: the shard's next records are refused
        without opening it."""
        self._refused[number] = (time.monotonic(), why)
        return RecordError(record_key(info.first), why)

    def _close(self, number: int) -> None:
        self._open.pop(number).close()
        self._checked.pop(number, None)
        self._inode.pop(number, None)

    def _evicted(self, number: int, now: Optional[float] = None) -> bool:
        """Whether an open shard's file left a bounded cache (gone, or fetched again: another file). Held open, an
        evicted (unlinked) shard would keep its disk space past the budget and never be fetched again; looked at
        most every CHECK_EVICTED_S (``now=inf``: at once). A shard still in place is marked recently used."""
        clock = time.monotonic()
        if not self.source.evicts or (now or clock) - self._checked.get(number, 0.0) < CHECK_EVICTED_S:
            return False
        self._checked[number] = clock
        path, inode = self._inode[number]
        try:
            if os.stat(path).st_ino != inode:
                return True
            os.utime(path.parent)  # in use: the cache evicts least recently used folders first
        except OSError:
            return True
        return False

    def read(self, index: int) -> dict[str, Any]:
        """Record ``index`` (global); RecordError if it is corrupt or its shard cannot be had."""
        first, end, number = self._last_span
        if not first <= index < end:
            number = self.manifest.shard_of(index)  # IndexError outside the dataset
            shards = self.manifest.shards
            first = int(shards.first[number])  # the columns: no ShardInfo a read
            end = first + int(shards.records[number])
            self._last_span = (first, end, number)
        try:
            shard = self._shard(number)
        except RecordError as exc:  # the shard's failure, said of the record asked for (it names the shard)
            raise RecordError(record_key(index), exc.reason) from None
        return shard.read(index - first)

    def size_bytes(self) -> int:
        return int(self.manifest.shards.bytes.sum())

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
        """Close every open shard and the source (a cache's fetch-ahead thread ends)."""
        while self._open:
            self._open.popitem()[1].close()
        self.source.close()

    def __enter__(self) -> "ShardedDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
