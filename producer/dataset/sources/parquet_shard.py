"""Parquet shards: one Parquet file is one shard of a sharded dataset (``shard_format.py``'s door, issue 42).

A Hugging Face dataset is a folder of Parquet files, each a few row groups of rows; ``parquet_index`` writes the
manifest (the "index") naming every file, its rows, size and SHA-256, and the columns read as fields. Columns become
fields by type (``column_kind``): the Hugging Face image struct ``{bytes, path}`` -> ``image`` (its bytes as
stored), binary -> ``bytes``, string -> ``str``, integers -> ``int``, floats -> ``float``, bool -> ``bool``.

``ParquetShard`` reads rows by index. pyarrow trusts what it decodes, so the footer is checked against limits
before a byte of data is read: its size (read from the file's last 8 bytes, and pyarrow's thrift limits), the row
count against the manifest, the number of row groups, each row group's rows, each read column chunk's uncompressed
size and their sum per row group (what one decode holds), and the schema against the manifest's fields. Only the
manifest's columns of a row group are decoded, byte columns as dictionaries so a dictionary page repeated over many
rows is never expanded.

Decoded row groups are kept as Arrow arrays in ``DecodedGroups`` (``parquet/decoded.py``), one least-recently-used
cache per format object, shared by every shard it opens and bounded by the groups' decoded bytes
(``DECODED_CACHE_BYTES``, 1 GiB): a producer reads a shard's records in a shuffled order, and with one group kept
every record cost a whole group's decode (~135 records/s against ~53,000 in order). The registry asks
``make_format()`` for a fresh format for each dataset opened (``shard_format.py``), so the cache is the dataset's
and is freed with it; nothing process-wide. A row is converted to Python when read, after its byte and text values
(their Arrow lengths, summed per group) are checked against ``MAX_RECORD_BYTES`` as a tar's or an LMDB record's
are. A group larger than the budget is decoded anyway, alone, and named in a warning once a shard.

Byte columns are read as dictionaries even where the footer says a chunk has no dictionary page: the footer is not
to be trusted (a lying one would let a dictionary bomb expand), and pyarrow's own writer gives nearly every column
chunk a dictionary page before falling back to plain pages, so the footer would spare the hashing of few files.

What these checks cannot bound: page headers and encodings inside the column chunks (a crafted
DELTA_BYTE_ARRAY page can still make pyarrow allocate more than the footer says), and pyarrow 26 itself: a footer
whose column chunk carries size statistics of the wrong length makes ``RowGroupMetaData.column(i)`` throw a C++
exception through a Cython accessor that cannot pass it on, and the process aborts (SIGABRT; found by fuzzing the
footer; data-page mutations raise cleanly). Shards are opened and decoded in the producer's worker processes, whose
deaths the daemon supervises and whose poisoned records are quarantined (``producer/supervision/``): a shard that
kills workers costs its records, never the producer; no sandbox of our own is built. Any Python-level error while decoding is a
``RecordError`` naming the shard and row group; a null or mistyped value is one naming the column and row.
"""

from __future__ import annotations

import bisect
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from stoker.producer.dataset.sources.lmdb_format import MAX_RECORD_BYTES, DatasetError, DatasetMeta, RecordError
from stoker.producer.dataset.sources.parquet.decoded import (DECODED_CACHE_BYTES, DecodedGroups, Group, decoded_group,
                                                             split)

NAME = "parquet"
LOCAL_NAME = "shard.parquet"
MAX_FOOTER_BYTES = 16 * 1024 * 1024  # a Hugging Face file's footer is kilobytes; thousands of row groups fit
MAX_ROW_GROUPS = 65_536
MAX_GROUP_ROWS = 1 << 22  # decoded offsets and numbers stay ~8 bytes a row a column: tens of MiB
MAX_CHUNK_BYTES = 512 * 1024 * 1024  # one column chunk's uncompressed size
MAX_GROUP_BYTES = 512 * 1024 * 1024  # the read columns of one row group together: what one decode holds
THRIFT_LIMIT = MAX_FOOTER_BYTES
_MAGIC = b"PAR1"
log = logging.getLogger("stoker.producer")


def image_struct(kind: pa.DataType) -> bool:
    """Whether ``kind`` is the Hugging Face image struct: ``{bytes: binary, path: string}`` (``path`` optional)."""
    if not pa.types.is_struct(kind):
        return False
    names = {kind.field(i).name: kind.field(i).type for i in range(kind.num_fields)}
    return ("bytes" in names and set(names) <= {"bytes", "path"} and _is_binary(names["bytes"])
            and ("path" not in names or _is_string(names["path"])))


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def column_kind(kind: pa.DataType) -> Optional[str]:
    """The field kind a column of arrow type ``kind`` is read as, None for a type Stoker does not read."""
    if image_struct(kind):
        return "image"
    if _is_binary(kind):
        return "bytes"
    if _is_string(kind):
        return "str"
    if pa.types.is_boolean(kind):
        return "bool"
    if pa.types.is_integer(kind):
        return "int"
    if pa.types.is_floating(kind):
        return "float"
    return None


def _fits(field_kind: str, column: Optional[str]) -> bool:
    # a binary column may be served as an image (its bytes are an encoded image); otherwise kinds match exactly
    return column == field_kind or (field_kind == "image" and column == "bytes")


class ParquetShard:
    """One local Parquet file's rows (module doc). ``open`` checks the footer (DatasetError naming what is wrong);
    ``read(i)`` gives row ``i`` as a dict of the manifest's fields, or RecordError. Its decoded row groups are kept
    in ``decoded`` (shared with the format's other shards) until evicted or the shard is closed."""

    def __init__(self, path: Path, info: Any, meta: DatasetMeta, decoded: DecodedGroups) -> None:
        self.name, self.first = str(info.name), int(info.first)
        self._decoded, self._owner, self._warned = decoded, decoded.new_owner(), False
        self._where = f"Parquet shard {self.name} ({path})"
        _check_footer_size(path, self._where)
        self._fields = dict(meta.fields)
        try:
            probe = pq.ParquetFile(path, thrift_string_size_limit=THRIFT_LIMIT, pre_buffer=False,
                                   thrift_container_size_limit=THRIFT_LIMIT, schema_depth_limit=16)
            schema = probe.schema_arrow
            self._leaves = self._plan(schema)  # field -> the leaf columns read ("image.bytes")
            byte_leaves = [leaf for f, leaf in self._leaves.items() if self._byte_typed(schema.field(f).type)]
            probe.close()
            # byte columns decode as dictionaries: a dictionary page repeated over many rows is never expanded
            self._file = pq.ParquetFile(path, thrift_string_size_limit=THRIFT_LIMIT, pre_buffer=False,
                                        thrift_container_size_limit=THRIFT_LIMIT, schema_depth_limit=16,
                                        read_dictionary=byte_leaves)
            self._starts, self._sizes = check_row_groups(self._file.metadata, int(info.records),
                                                         set(self._leaves.values()), self._where)
        except DatasetError:
            raise
        except OSError as exc:
            if not path.exists():
                raise  # an evicted cache entry: the caller asks again
            raise DatasetError(f"{self._where}: not a readable Parquet file ({exc}); re-index or replace it") from None
        except (pa.ArrowException, ValueError, TypeError, IndexError, MemoryError) as exc:
            raise DatasetError(f"{self._where}: not a readable Parquet file ({exc}); re-index or replace it") from None

    @staticmethod
    def _byte_typed(kind: pa.DataType) -> bool:
        return image_struct(kind) or _is_binary(kind) or _is_string(kind)

    def _plan(self, schema: pa.Schema) -> dict[str, str]:
        leaves = {}
        for field, kind in self._fields.items():
            index = schema.get_field_index(field)
            if index < 0:
                raise DatasetError(f"{self._where} has no column {field!r} (the manifest's fields: "
                                   f"{', '.join(self._fields)}): re-index the dataset")
            column = column_kind(schema.field(index).type)
            if not _fits(kind.kind, column):
                raise DatasetError(f"{self._where}: column {field!r} is {schema.field(index).type} ({column or 'not read'}"
                                   f"), the manifest says {kind}: re-index the dataset")
            leaves[field] = f"{field}.bytes" if column == "image" else field
        return leaves

    def __len__(self) -> int:
        return self._file.metadata.num_rows

    def read(self, index: int) -> dict[str, Any]:
        """Row ``index`` of this file as ``{field: value}``; RecordError naming the shard, row group, column."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} is outside {self._where}'s {len(self)}")
        group = bisect.bisect_right(self._starts, index) - 1
        columns, row_bytes = self._decoded.get((self._owner, group)) or self._decode(group, index)
        row = index - self._starts[group]
        if row_bytes[row] > MAX_RECORD_BYTES:  # before a Python object is made of any value
            raise self._error(index, f"row {index} (row group {group}) holds {int(row_bytes[row])} bytes in its byte "
                              f"and text columns, more than {MAX_RECORD_BYTES}: leave the column out of the index "
                              "(stoker data index --fields) or rewrite the file with smaller values")
        record = {}
        for field, (values, codes) in columns.items():
            try:
                code = codes[row].as_py() if codes is not None else row
                value = values[code].as_py() if code is not None and 0 <= code < len(values) else None
            except (pa.ArrowException, ValueError, IndexError) as exc:  # a string that is not UTF-8
                raise self._error(index, f"column {field!r} of row {index} (row group {group}) cannot be read "
                                  f"({exc}); the file is corrupt: replace it and re-index") from None
            if value is None:
                raise self._error(index, f"column {field!r} is null in row {index} (row group {group})")
            record[field] = _CONVERT[self._fields[field].kind](value)
        return record

    def _decode(self, group: int, index: int) -> Group:
        """Row group ``group``'s columns decoded and kept in the shared cache, room made first by the footer's
        uncompressed size of the columns (so the cache and the decode together stay near the budget)."""
        self._decoded.make_room(self._sizes[group])
        try:
            table = self._file.read_row_group(group, columns=list(self._leaves.values()), use_threads=False)
            columns = {}
            for field in self._leaves:
                array = table.column(field).combine_chunks()
                if pa.types.is_struct(array.type):
                    array = array.flatten()[0]  # the image's bytes, null where the struct is null
                columns[field] = split(array)
            decoded = decoded_group(columns, table.num_rows)
            del table
        except (pa.ArrowException, OSError, ValueError, TypeError, IndexError, KeyError, MemoryError) as exc:
            raise self._error(index, f"row group {group} cannot be decoded ({type(exc).__name__}: {exc}); "
                              "the file is corrupt: replace it and re-index") from None
        nbytes = decoded.nbytes
        if not self._decoded.put((self._owner, group), decoded, nbytes) and not self._warned:
            self._warned = True
            log.warning("%s: row group %d decodes to %d bytes, more than the %d bytes kept for decoded row groups: "
                        "each of its groups is decoded again whenever another group was read between; rewrite the "
                        "file with smaller row groups (pyarrow's row_group_size) or raise DECODED_CACHE_BYTES",
                        self._where, group, nbytes, self._decoded.budget)
        return decoded

    def _error(self, index: int, why: str) -> RecordError:
        return RecordError(b"%d" % (self.first + index), f"{self._where}: {why}")

    def close(self) -> None:
        """Close the file and let go of the row groups this shard decoded."""
        self._decoded.drop(self._owner)
        self._file.close()


def check_row_groups(metadata: pq.FileMetaData, records: int, wanted: set[str],
                     where: str) -> tuple[list[int], list[int]]:
    """Each row group's first row and the uncompressed bytes of its ``wanted`` leaf columns, after the footer's
    counts and sizes are checked (module doc): ``records`` the rows the manifest says; DatasetError naming the
    group and column."""
    if metadata.num_rows != records:
        raise DatasetError(f"{where} holds {metadata.num_rows} rows, the manifest says {records}: re-index it")
    if not 0 < metadata.num_row_groups <= MAX_ROW_GROUPS:
        raise DatasetError(f"{where}: {metadata.num_row_groups} row groups (1 to {MAX_ROW_GROUPS})")
    starts, sizes, total = [], [], 0
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        if not 0 <= group.num_rows <= MAX_GROUP_ROWS:
            raise DatasetError(f"{where}: row group {g} claims {group.num_rows} rows (at most {MAX_GROUP_ROWS}): "
                               "rewrite it with smaller row groups")
        read = 0
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema not in wanted:
                continue
            size = chunk.total_uncompressed_size
            if not 0 <= size <= MAX_CHUNK_BYTES or not 0 <= chunk.total_compressed_size <= MAX_CHUNK_BYTES:
                raise DatasetError(f"{where}: row group {g} column {chunk.path_in_schema} claims {size} bytes "
                                   f"uncompressed (at most {MAX_CHUNK_BYTES}): rewrite it with smaller row groups")
            read += size
        if read > MAX_GROUP_BYTES:
            raise DatasetError(f"{where}: row group {g} holds {read} bytes in the columns read (at most "
                               f"{MAX_GROUP_BYTES}): rewrite it with smaller row groups")
        starts.append(total)
        sizes.append(read)
        total += group.num_rows
    if total != records:
        raise DatasetError(f"{where}: its row groups hold {total} rows, its footer says {metadata.num_rows}")
    return starts, sizes


def _check_footer_size(path: Path, where: str) -> None:
    """The footer's length from the file's last 8 bytes, bounded before pyarrow reads it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 12:
            raise DatasetError(f"{where}: {size} bytes is too short for a Parquet file; replace it and re-index")
        f.seek(size - 8)
        tail = f.read(8)
        f.seek(0)
        head = f.read(4)
    length = int.from_bytes(tail[:4], "little")
    if head != _MAGIC or tail[4:] != _MAGIC:
        raise DatasetError(f"{where}: no PAR1 magic at both ends: not a Parquet file (truncated?); replace it")
    if not 0 < length <= min(MAX_FOOTER_BYTES, size - 12):
        raise DatasetError(f"{where}: footer of {length} bytes in a {size}-byte file (at most {MAX_FOOTER_BYTES}): "
                           "corrupt or not Parquet")


def _float(value: Any) -> float:
    return float(value)


_CONVERT: dict[str, Callable[[Any], Any]] = {"image": bytes, "bytes": bytes, "str": str, "int": int,
                                             "float": _float, "bool": bool}


class ParquetFormat:
    """``ShardFormat`` for Parquet (``shard_format.py``): a shard is one file, its object its name under the root.
    ``decoded`` holds the decoded row groups of every shard it opens (module doc): one dataset's."""

    name = NAME
    local_name = LOCAL_NAME

    def __init__(self, decoded: Optional[DecodedGroups] = None) -> None:
        self.decoded = decoded if decoded is not None else DecodedGroups()

    def object_name(self, shard_name: str) -> str:
        return shard_name

    def open(self, path: Path, info: Any, meta: DatasetMeta) -> ParquetShard:
        return ParquetShard(Path(path), info, meta, self.decoded)


def make_format() -> ParquetFormat:
    """A fresh format with its own decoded row group cache of ``DECODED_CACHE_BYTES``: the registry's
    (``shard_format.shard_format``) for each dataset opened, so no cache outlives or is shared past its dataset."""
    return ParquetFormat(DecodedGroups(DECODED_CACHE_BYTES))
