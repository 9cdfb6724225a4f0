"""The bounded local cache a sharded dataset in object storage is read through: ``ShardCache`` makes a shard local
on first use (``object_storage.open_remote`` gives each such dataset one):

- *Content-addressed*: a shard is cached under its SHA-256 (``CACHE/shards/<sha256>/LOCAL``, its format's
  ``local_name``: ``data.mdb``, ...), so datasets and URLs that share a shard share its copy, and a cached shard is
  one whose bytes were checked. The object fetched is ``ROOT/`` its format's ``object_name``.
- *Never a partial shard*: bytes stream into ``CACHE/tmp/`` while being hashed; only a shard whose size and
  SHA-256 match the manifest is renamed into place. A mismatch is fetched once more, then refused.
- *Bounded*: before a fetch, the least recently used shards go until the new one fits ``cache_bytes``. A budget
  smaller than one shard is refused at start naming the flag. A shard evicted while a worker reads it stays
  readable until that worker's next record of it, when the reader sees it gone, closes it and asks again
  (Linux keeps an unlinked file until closed), so the budget is passed by at most the records in flight.
- *One fetch per shard on a host*: the daemon's worker processes share the cache folder; an ``flock`` per shard
  makes the others wait for the first fetch instead of fetching again.
- *Transient errors are retried* with exponential backoff (0.5 s doubling to 8 s) for up to ``retry_seconds``
  (throttling, 5xx, timeouts, a server restart: the reading worker waits, its producer's trainers see a stall
  and its reason); a missing object, missing or refused credentials are not (``storage_retry.classify``). A set
  ``cancel`` event (the daemon stopping) ends every wait at once. A shard that cannot be had raises
  ``ShardUnavailable`` (its records are skipped, counted and named), remembered for ``FAILED_HOLD_S`` so each of
  its records does not fetch again.
- *Fetched ahead* (``prefetch``): a reader going shard by shard asks for the next shard while it reads this
  one; one background thread per process fetches it through the same locks, so the read finds it in place.
- *Counted*: every fetch appends one JSON line to ``CACHE/fetches.jsonl`` (shard, bytes, seconds, worker pid,
  whether it was ahead), so a benchmark or an operator counts fetches across processes; ``stoker produce`` logs
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import queue
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from stoker.protocol.exact_messages import MAX_HELD
from stoker.producer.dataset.sources.manifest import ShardInfo, ShardTable
from stoker.producer.dataset.sources.shard_format import ShardFormat
from stoker.producer.dataset.sources.sharded import ShardUnavailable
from stoker.producer.dataset.sources.storage_retry import FetchWatch, StorageCancelled, retried

log = logging.getLogger("stoker.producer")

DEFAULT_CACHE_BYTES = 64 * 10**9
DEFAULT_RETRY_SECONDS = 300.0
FAILED_HOLD_S = 30.0
CHUNK = 4 << 20
PREFETCH_MIN_SHARDS = 3  # a budget of fewer shards fetches nothing ahead: it would evict the shard being read
# Shards waiting to be fetched ahead at most: a block of shards of unequal record counts may touch many, all asked
# for at its start (the budget permitting, ``prefetch``); more are dropped and fetched by their reads.
PREFETCH_AHEAD_SHARDS = 8
PREFETCH_THREAD = "stoker-prefetch"
CLOSE_WAIT_S = 5.0  # close() waits this long for a fetch ahead in flight (the thread is a daemon past it)
FETCH_LOG = "fetches.jsonl"  # one JSON line per fetch, in the cache's folder (``fetch_log``)
INDEX_NAME = "shard.index"  # beside a cached copy: its format's index of it (``index_file``)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoker" / "shards"


def fetch_log(cache_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every fetch the cache at ``cache_dir`` made (``fetches.jsonl``, written by ``ShardCache``), oldest first; an
    empty list before the first."""
    path = Path(cache_dir) / FETCH_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class ShardCache:
    """See the module doc. ``fs``: an fsspec filesystem; ``root``: the dataset's prefix in it (where its shard
    objects are); ``shard_format``: how a shard's object and cached file are named; ``cancel``: set, it
    ends every wait (retries, locks) at once with StorageCancelled; ``watch``: hears of waits on storage and of
    the time reads waited for fetches (a producer's worker sets it: its status, stage times and metrics)."""

    evicts = True  # readers let go of a shard evicted under them (ShardedDataset), so the budget holds

    def __init__(self, cache_dir: Path, cache_bytes: int, fs: Any, root: str, shard_format: ShardFormat,
                 retry_seconds: float = DEFAULT_RETRY_SECONDS, cancel: Optional[threading.Event] = None) -> None:
        self.dir, self.cache_bytes, self.fs, self.root = Path(cache_dir), cache_bytes, fs, root.rstrip("/")
        self.format, self.local_name = shard_format, shard_format.local_name
        self.retry_seconds, self.cancel = retry_seconds, cancel
        self.watch: Optional[FetchWatch] = None
        for sub in ("shards", "tmp", "locks"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._failed: dict[str, tuple[float, str]] = {}  # sha -> (when, why): not fetched again for a while
        self._numbers: Optional[tuple[int, ShardTable]] = None  # (capacity, the shards it is of), for holdings
        self._prefetcher: Optional[threading.Thread] = None
        self._prefetch_queue: queue.Queue = queue.Queue(maxsize=PREFETCH_AHEAD_SHARDS)

    def local(self, shard: ShardInfo) -> Path:
        """The path of ``shard``'s checked local file, fetched first if needed; ShardUnavailable if it cannot be
        (an error of the cache folder itself too: a worker never dies of one)."""
        final = self.dir / "shards" / shard.sha256 / self.local_name
        if _touch(final):  # cached: now the most recently used
            return final
        t0 = time.monotonic()
        try:
            return self._local(shard, final)
        except OSError as exc:
            raise ShardUnavailable(f"shard {shard.name}: the cache at {self.dir} failed: {exc}") from None
        finally:  # what a read waited for its shard (a fetch ahead waits for nobody)
            if self.watch is not None and threading.current_thread().name != PREFETCH_THREAD:
                self.watch.fetched(time.monotonic() - t0)

    def index_file(self, shard: ShardInfo) -> Path:
        """Where a format keeps what it derives from ``shard`` (a tar's sample index): in its cached copy's folder,
        so it is counted in the budget and evicted with the copy (``sharded.ShardSource.index_file``)."""
        return self.dir / "shards" / shard.sha256 / INDEX_NAME

    def holdings(self, shards: Sequence[ShardInfo]) -> tuple[int, list[int]]:
        """``(capacity, held)`` of ``ShardedDataset.holdings``: the budget over the mean shard size (1 at least), and
        the shards (numbers in ``shards``) cached now, least recently used first. Lists the cache's folder (what
        the budget holds), not the manifest."""
        self.holdings_capacity(shards)
        capacity, numbers = self._numbers  # type: ignore[misc]
        held = []
        try:
            entries = list(os.scandir(self.dir / "shards"))
        except OSError:
            return capacity, []
        for entry in entries:
            number = numbers.number_of_sha(entry.name)  # a binary search: no dict of 10^6 SHA-256s
            try:
                if number is not None and os.path.isfile(os.path.join(entry.path, self.local_name)):
                    held.append((entry.stat().st_mtime, number))  # its folder's time is its use (``_touch``)
            except OSError:
                continue
        return capacity, [number for _, number in sorted(held)[-MAX_HELD:]]

    def prefetch(self, shards: Sequence[ShardInfo], number: int) -> None:
        """Fetch ``shards[number]`` on this process's prefetch thread (started on first use), if the budget holds
        ``PREFETCH_MIN_SHARDS`` shards and this one fits beside those waiting: a budget of C shards keeps at most
        C - PREFETCH_MIN_SHARDS + 1 waiting (and ``PREFETCH_AHEAD_SHARDS``), else the fetches ahead would evict the
        shard being read; one that does not fit is dropped (its read fetches it). A failure is left to the read
        that needs the shard (it fetches again, or finds it failed, and reports it)."""
        capacity = self.holdings_capacity(shards)
        if capacity < PREFETCH_MIN_SHARDS or self._prefetch_queue.qsize() > capacity - PREFETCH_MIN_SHARDS:
            return
        if self._prefetcher is None:
            self._prefetcher = threading.Thread(target=self._prefetch_loop, name=PREFETCH_THREAD, daemon=True)
            self._prefetcher.start()
        try:
            self._prefetch_queue.put_nowait(shards[number])
        except queue.Full:
            pass  # the reads are ahead of the fetches: this one will fetch it itself

    def close(self) -> None:
        """End the prefetch thread, if one runs: what waits to be fetched ahead is dropped, a fetch in flight is
        waited for up to ``CLOSE_WAIT_S`` (a set ``cancel`` ends it at once). The cached shards stay."""
        thread, self._prefetcher = self._prefetcher, None
        if thread is None:
            return
        while True:
            try:
                self._prefetch_queue.get_nowait()
            except queue.Empty:
                break
        self._prefetch_queue.put(None)  # room: just drained, and only this thread puts now
        thread.join(CLOSE_WAIT_S)

    def _prefetch_loop(self) -> None:
        while True:
            shard = self._prefetch_queue.get()
            if shard is None:  # close()
                return
            try:
                self.local(shard)
            except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - a hint failed (or was stopped); the read
                log.debug("fetching shard %s ahead failed (%s); its read will fetch it", shard.name, exc)

    def holdings_capacity(self, shards: Sequence[ShardInfo]) -> int:
        """Shards the budget holds: the budget over the mean shard size, 1 at least."""
        if self._numbers is None or self._numbers[1] is not shards:
            table = ShardTable.of(shards)
            mean = int(table.bytes.sum()) / max(1, len(table))
            self._numbers = (max(1, int(self.cache_bytes // max(1, mean))), table)
        return self._numbers[0]

    def _local(self, shard: ShardInfo, final: Path) -> Path:
        if _touch(final):  # cached: now the most recently used
            return final
        failed = self._failed.get(shard.sha256)
        if failed is not None and time.monotonic() - failed[0] < FAILED_HOLD_S:
            raise ShardUnavailable(failed[1])
        for _ in range(3):  # evicted by another worker between its fetch and our touch: fetch again
            try:
                with self._shard_lock(shard):
                    if not final.is_file():  # another worker may have fetched it while we waited
                        self._fetch(shard, final)
            except ShardUnavailable as exc:
                self._failed[shard.sha256] = (time.monotonic(), str(exc))
                raise
            if _touch(final):
                return final
        raise ShardUnavailable(f"shard {shard.name} was evicted three times as soon as it was fetched: the cache "
                               "budget is too small for the workers reading at once; raise --cache-size")

    def _shard_lock(self, shard: ShardInfo) -> "_Flock":
        # a fetch may retry for retry_seconds, twice (a mismatch is fetched once more), and wait for the budget
        return _Flock(self.dir / "locks" / f"{shard.sha256}.lock", 3 * self.retry_seconds + 120.0, shard.name,
                      self.cancel)

    def _fetch(self, shard: ShardInfo, final: Path) -> None:
        if shard.bytes > self.cache_bytes:
            raise ShardUnavailable(f"shard {shard.name} is {shard.bytes} bytes, more than the whole cache "
                                   f"({self.cache_bytes}): raise --cache-size")
        reservation = self.dir / "tmp" / f"{shard.sha256}.{os.getpid()}.{shard.bytes}.reserved"
        deadline = time.monotonic() + self.retry_seconds
        while True:
            with _Flock(self.dir / "locks" / "budget.lock", 60.0, "the cache budget", self.cancel):
                if self._make_room(shard.bytes, keep=final.parent):
                    reservation.touch()  # used until the shard is in place: concurrent fetches share the budget
                    break
            if time.monotonic() > deadline:  # what is left is other workers' fetches in flight: wait for them
                raise ShardUnavailable(f"shard {shard.name}: no room in the cache's {self.cache_bytes} bytes for "
                                       f"{self.retry_seconds:.0f} s while other fetches ran: raise --cache-size")
            _pause(0.1, self.cancel, f"shard {shard.name}: waiting for room in the cache")
        try:
            self._fetch_checked(shard, final)
        finally:
            reservation.unlink(missing_ok=True)

    def _fetch_checked(self, shard: ShardInfo, final: Path) -> None:
        url = f"{self.root}/{self.format.object_name(shard.name)}"
        t0 = time.monotonic()
        for attempt in (1, 2):
            tmp = self.dir / "tmp" / f"{shard.sha256}.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                digest, size = retried(f"fetching {url}", lambda: self._download(url, tmp, shard.bytes),
                                       self.retry_seconds, self.cancel, self.watch)
                if size == shard.bytes and digest == shard.sha256:
                    staged = tmp.parent / f"{tmp.name}.dir"
                    staged.mkdir()
                    os.rename(tmp, staged / final.name)
                    if final.parent.exists():  # an index written while its shard was evicted: it goes with it
                        shutil.rmtree(final.parent)
                    os.rename(staged, final.parent)  # atomic: the folder appears with its checked file in it
                    break
                why = (f"shard {shard.name} from {url} is {size} bytes with SHA-256 {digest[:16]}..., the manifest "
                       f"says {shard.bytes} bytes, {shard.sha256[:16]}...")
                if attempt == 2:
                    raise ShardUnavailable(f"{why}: the object does not match the manifest (rebuild and upload "
                                           "the dataset, or fix the manifest)")
                log.warning("%s; fetching it once more", why)
            finally:
                if tmp.exists():
                    tmp.unlink()
        seconds = time.monotonic() - t0
        log.info("fetched shard %s (%.1f MB in %.2f s) into %s", shard.name, shard.bytes / 1e6, seconds, self.dir)
        with open(self.dir / FETCH_LOG, "a") as out:  # one short line per write: O_APPEND keeps them whole
            out.write(json.dumps({"shard": shard.name, "sha256": shard.sha256, "bytes": shard.bytes,
                                  "seconds": round(seconds, 4), "pid": os.getpid(),
                                  "ahead": threading.current_thread().name == PREFETCH_THREAD}) + "\n")

    def _download(self, url: str, tmp: Path, expected: int) -> tuple[str, int]:
        """``(sha256, size)`` of the object, streamed into ``tmp``; it stops one block past ``expected`` bytes (an
        object larger than the manifest says never fills the disk)."""
        digest, size = hashlib.sha256(), 0
        with self.fs.open(url, "rb", block_size=CHUNK) as src, open(tmp, "wb") as dst:
            while size <= expected and (chunk := src.read(CHUNK)):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        return digest.hexdigest(), size

    def _reserved(self) -> int:
        """Bytes of fetches in flight (``tmp/*.reserved``, named by sha, pid and bytes) whose process lives; what
        a dead process left in ``tmp/`` (a worker killed mid-fetch) is removed."""
        total = 0
        for entry in (self.dir / "tmp").iterdir():
            parts = entry.name.split(".")
            pid = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
            if pid is not None and not _alive(pid):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            elif entry.name.endswith(".reserved") and len(parts) == 4 and parts[2].isdigit():
                total += int(parts[2])
        return total

    def _make_room(self, needed: int, keep: Path) -> bool:
        """Evict least recently used shards until ``needed`` more bytes fit the budget, counting the fetches in
        flight; whether they fit now. The caller holds the budget lock."""
        cached = []
        for folder in (self.dir / "shards").iterdir():
            try:  # a folder holds one shard's file, of whichever format (datasets may share the cache)
                cached.append((folder.stat().st_mtime, sum(f.stat().st_size for f in os.scandir(folder)), folder))
            except OSError:
                continue  # evicted meanwhile by another worker (or not a shard's folder)
        used = sum(size for _, size, _ in cached) + self._reserved()
        for _, size, folder in sorted(cached):
            if used + needed <= self.cache_bytes:
                break
            if folder != keep:
                shutil.rmtree(folder, ignore_errors=True)
                used -= size
                log.info("evicted shard %s (%.1f MB) from the cache: the budget is %d bytes", folder.name[:16],
                         size / 1e6, self.cache_bytes)
        return used + needed <= self.cache_bytes


def _pause(seconds: float, cancel: Optional[threading.Event], what: str) -> None:
    """Sleep ``seconds``, or raise StorageCancelled as soon as ``cancel`` is set."""
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise StorageCancelled(f"{what}: stopped")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _touch(file: Path) -> bool:
    """Mark a cached shard's folder most recently used; False if its file is not there (never fetched, or
    evicted)."""
    try:
        if file.is_file():
            os.utime(file.parent)
            return True
    except FileNotFoundError:
        pass
    return False


class _Flock:
    """An exclusive ``flock`` on ``path``, waited for at most ``timeout`` seconds (ShardUnavailable past it; a set
    ``cancel`` ends the wait with StorageCancelled)."""

    def __init__(self, path: Path, timeout: float, name: str, cancel: Optional[threading.Event] = None) -> None:
        self.path, self.timeout, self.name, self.cancel = path, timeout, name, cancel

    def __enter__(self) -> "_Flock":
        self.file = open(self.path, "a")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.file.close()
                    raise ShardUnavailable(f"shard {self.name}: another process has been fetching it for "
                                           f"{self.timeout:.0f} s") from None
                try:
                    _pause(0.05, self.cancel, f"shard {self.name}: waiting for another process's fetch")
                except StorageCancelled:
                    self.file.close()
                    raise

    def __exit__(self, *exc: object) -> None:
        self.file.close()
