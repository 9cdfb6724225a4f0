"""A WebDataset tar as a shard (``"shard_format": "tar"``): ``FORMAT`` is its ``shard_format.ShardFormat``.

A tar shard is its own object (``000123.tar`` under the index's root), cached as ``shard.tar``. ``TarShard`` opens
one local tar and indexes its samples at once by walking its headers (``webdataset.headers``: bodies seeked over,
never read; every length bounded), held as NumPy arrays (``webdataset.samples``). A tar that ends early (truncated,
a garbled header) keeps the samples wholly before that point; it is refused (DatasetError naming the shard, what
the walk found and why it stopped) only when the samples indexed are not the manifest's ``records`` for it.

``read(i)`` reads sample ``i``'s members with ``pread`` (one per member; never the whole tar) and makes them the
dataset's fields by extension (``webdataset.fields``: image, text, label, json, other bytes). A member's bytes that
break their field's rule, or a sample missing a field the manifest lists, are a RecordError naming the shard, the
sample's key and the field: the worker skips and counts that sample, the producer keeps serving.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from stoker.producer.dataset.sources.lmdb_format import MAX_RECORD_BYTES, DatasetError, DatasetMeta, RecordError
from stoker.producer.dataset.sources.webdataset.fields import field_of, value_of
from stoker.producer.dataset.sources.webdataset.headers import FileBlocks, TarLimits, TarWalk
from stoker.producer.dataset.sources.webdataset.samples import SampleBuilder, SampleIndex


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
                 limits: TarLimits = TarLimits()) -> None:
        """Open and index ``path`` (shard ``name`` of a dataset with ``meta``); DatasetError if it is not a tar
        holding ``records`` samples (None: any number), OSError if the file is not there."""
        self.path, self.name, self.meta = path, name, meta
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self.index, self.walk = index_tar(self._fd, name, limits)
            self._fields = self._fields_of_extensions(meta)
        except BaseException:
            os.close(self._fd)
            raise
        if records is not None and len(self.index) != records:
            os.close(self._fd)
            found = "; ".join(filter(None, [self.walk.ended, *self.walk.problems[:3]]))
            raise DatasetError(f"tar shard {name} holds {len(self.index)} whole samples, the manifest says {records}"
                               f"{': ' + found if found else ''}; index the data again (stoker data index) if it "
                               "changed, or fetch the shard again if it is damaged")

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
        lo, hi = int(idx.starts[index]), int(idx.starts[index + 1])
        members = [(self._fields[k], int(o), int(s))
                   for k, o, s in zip(idx.kinds[lo:hi], idx.offsets[lo:hi], idx.sizes[lo:hi])]
        wanted = [(field, offset, size) for field, offset, size in members if field is not None]
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


class TarShardFormat:
    """A WebDataset tar shard (``shard_format.ShardFormat``): its object is its name under the root."""

    name = "tar"
    local_name = "shard.tar"

    def object_name(self, shard_name: str) -> str:
        return shard_name

    def open(self, path: Path, info: Any, meta: DatasetMeta) -> TarShard:
        """The tar at ``path`` as shard ``info`` (a ``manifest.ShardInfo``); DatasetError if it does not hold
        ``info.records`` whole samples."""
        return TarShard(path, info.name, meta, info.records)


FORMAT = TarShardFormat()
