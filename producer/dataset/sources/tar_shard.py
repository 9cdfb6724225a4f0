"""A WebDataset tar as a shard (``"shard_format": "tar"``): ``FORMAT`` is its ``shard_format.ShardFormat``.

A tar shard is its own object (``000123.tar`` under the index's root), cached as ``shard.tar``. ``TarShard`` opens
one local tar and indexes its samples at once by walking its headers (``webdataset.headers``: bodies seeked over,
never read; every length bounded), held as NumPy arrays (``webdataset.samples``). A tar that ends early (truncated,
a garbled header) keeps the samples wholly before that point; it is refused (DatasetError naming the shard, what
the walk found and why it stopped) only when the samples indexed are not the manifest's ``records`` for it.

Given an ``index_file`` (where its shard source lets it keep one: ``sharded.ShardSource.index_file``) and the
tar's SHA-256, the index is loaded from that file when it holds this tar's whole index (``webdataset.index_file``:
parsed and checked, never trusted), else built by the walk and written there for the next process; a file that
cannot be read or written only costs the walk (logged at debug; a refused file at info, then overwritten).

``read(i)`` reads sample ``i``'s members with ``pread`` (one per member; never the whole tar) and makes them the
dataset's fields by extension (``webdataset.fields``: image, text, label, json, other bytes). A member's bytes that
break their field's rule, or a sample missing a field the manifest lists, are a RecordError naming the shard, the
sample's key and the field: the worker skips and counts that sample, the producer keeps serving.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from stoker.producer.dataset.sources.lmdb_format import MAX_RECORD_BYTES, DatasetError, DatasetMeta, RecordError
from stoker.producer.dataset.sources.webdataset.fields import field_of, value_of
from stoker.producer.dataset.sources.webdataset.headers import FileBlocks, TarLimits, TarWalk
from stoker.producer.dataset.sources.webdataset.index_file import IndexFileRefused, load_index, save_index
from stoker.producer.dataset.sources.webdataset.samples import SampleBuilder, SampleIndex

log = logging.getLogger("stoker.producer")


def index_tar(fd: int, where: str, limits: TarLimits = TarLimits()) -> tuple[SampleIndex, TarWalk]:
    """The samples of the local tar open as ``fd`` and the walk that found them (its ``skipped``, ``problems`` and
    ``ended``); reads headers only, bounded by ``limits``."""
    walk = TarWalk(FileBlocks(fd), where, limits)
    builder = SampleBuilder(walk.skip)
    for name, offset, size in walk.members():
        builder.add(name, offset, size)
    return builder.finish(whole=not walk.ended, cut=walk.cut), walk


class TarShard:
    """One local tar's samples by index within the shard (``shard_format.ShardReader``; module doc)."""

    def __init__(self, path: Path, name: str, meta: DatasetMeta, records: Optional[int] = None,
                 limits: TarLimits = TarLimits(), index_file: Optional[Path] = None, sha256: str = "") -> None:
        """Open and index ``path`` (shard ``name`` of a dataset with ``meta``); DatasetError if it is not a tar
        holding ``records`` samples (None: any number), OSError if the file is not there. With ``index_file``,
        ``sha256`` (the manifest's, hex) and ``records``, the index is kept in that file (module doc); ``walk`` is
        then None when the index was loaded from it."""
        self.path, self.name, self.meta = path, name, meta
        self.walk: Optional[TarWalk] = None
        self._fd = os.open(path, os.O_RDONLY)
        try:
            keep = index_file if records is not None and _is_sha256(sha256) else None
            self.index = self._kept_index(keep, sha256, records, limits)
            if self.index is None:
                self.index, self.walk = index_tar(self._fd, name, limits)
                if keep is not None and len(self.index) == records:
                    self._keep_index(keep, sha256)
            self._fields = self._fields_of_extensions(meta)
        except BaseException:
            os.close(self._fd)
            raise
        if records is not None and len(self.index) != records:
            os.close(self._fd)
            walk = self.walk
            found = "; ".join(filter(None, [walk.ended, *walk.problems[:3]])) if walk is not None else ""
            raise DatasetError(f"tar shard {name} holds {len(self.index)} whole samples, the manifest says {records}"
                               f"{': ' + found if found else ''}; index the data again (stoker data index) if it "
                               "changed, or fetch the shard again if it is damaged")

    def _kept_index(self, index_file: Optional[Path], sha256: str, records: Optional[int],
                    limits: TarLimits) -> Optional[SampleIndex]:
        """The index kept in ``index_file`` if it is this tar's; None (walk the tar) if absent, refused or
        unreadable."""
        if index_file is None or records is None:
            return None
        try:
            return load_index(index_file, os.fstat(self._fd), sha256, records, limits)
        except FileNotFoundError:
            return None
        except IndexFileRefused as exc:
            log.info("tar shard %s: ignoring its index file %s (%s); indexing the tar again", self.name, index_file,
                     exc)
        except OSError as exc:
            log.debug("tar shard %s: cannot read its index file %s (%s); indexing the tar", self.name, index_file, exc)
        return None

    def _keep_index(self, index_file: Path, sha256: str) -> None:
        """Write the index just built for the next process to open the tar; a failure only costs it the walk."""
        try:
            save_index(index_file, self.index, os.fstat(self._fd), sha256)
        except (OSError, ValueError) as exc:
            log.debug("tar shard %s: cannot keep its index in %s (%s); each open walks the tar", self.name,
                      index_file, exc)

    def _fields_of_extensions(self, meta: DatasetMeta) -> list[Optional[tuple[str, str]]]:
        """Per extension of this tar: the (field, kind) it fills, None where the dataset has no such field.
        A manifest giving a tar field another kind than its extension makes is refused here, once."""
        out: list[Optional[tuple[str, str]]] = []
        for extension in self.index.extensions:
            field, kind = field_of(extension)
            want = meta.fields.get(field)
            if want is not None and want.kind != kind:
                raise DatasetError(f"tar shard {self.name}: the manifest makes field {field!r} a {want}, but .{extension} "
                                   f"members are {kind}: fix the manifest's 'fields' or index the data again")
            out.append((field, kind) if want is not None else None)
        return out

    def __len__(self) -> int:
        return len(self.index)

    def key(self, index: int) -> str:
        """Sample ``index``'s WebDataset key (``__key__``)."""
        return self.index.key(index)

    def read(self, index: int) -> dict[str, Any]:
        """Sample ``index``'s fields (the manifest's, by extension); RecordError naming the sample and what is
        wrong: a field missing, a value breaking its rule, or the file changed under us."""
        if not 0 <= index < len(self.index):
            raise RecordError(self._key_bytes(index), f"is outside tar shard {self.name}'s {len(self.index)} samples")
        idx = self.index
        lo, hi = idx.starts[index:index + 2].tolist()  # Python ints at once: a NumPy scalar each costs more
        fields = self._fields
        wanted = [(fields[k], o, s) for k, o, s in
                  zip(idx.kinds[lo:hi].tolist(), idx.offsets[lo:hi].tolist(), idx.sizes[lo:hi].tolist())
                  if fields[k] is not None]
        if sum(size for _, _, size in wanted) > MAX_RECORD_BYTES:
            raise RecordError(self._key_bytes(index), f"its members add up to more than {MAX_RECORD_BYTES} bytes")
        record: dict[str, Any] = {}
        for (field, kind), offset, size in wanted:
            if field in record:  # a second image extension (.jpg and .png): the first is the sample's image
                continue
            data = os.pread(self._fd, size, offset)
            if len(data) != size:
                raise RecordError(self._key_bytes(index), f"tar shard {self.name} is shorter than its index: the "
                                  "file changed after it was opened")
            try:
                record[field] = value_of(kind, data)
            except ValueError as exc:
                raise RecordError(self._key_bytes(index), f"field {field!r}: {exc}") from None
        missing = [f for f in self.meta.fields if f not in record]
        if missing:
            raise RecordError(self._key_bytes(index), f"has no field {missing[0]!r} (no member of its extension; "
                              f"it has {', '.join(sorted(record)) or 'none'}): the sample is skipped")
        return record

    def _key_bytes(self, index: int) -> bytes:
        key = self.index.key(index) if 0 <= index < len(self.index) else f"#{index}"
        return f"{self.name}:{key}".encode()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "TarShard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and not text.lower().strip("0123456789abcdef")


class TarShardFormat:
    """A WebDataset tar shard (``shard_format.ShardFormat``): its object is its name under the root."""

    name = "tar"
    local_name = "shard.tar"
    keeps_index = True  # ``open`` takes where its sample index may be kept (``shard_format.ShardFormat``)

    def object_name(self, shard_name: str) -> str:
        return shard_name

    def open(self, path: Path, info: Any, meta: DatasetMeta, index_file: Optional[Path] = None) -> TarShard:
        """The tar at ``path`` as shard ``info`` (a ``manifest.ShardInfo``), its index kept in ``index_file`` (None:
        walked at each open); DatasetError if it does not hold ``info.records`` whole samples."""
        return TarShard(path, info.name, meta, info.records, index_file=index_file, sha256=info.sha256)


FORMAT = TarShardFormat()
