"""The index of Parquet files served in place: a manifest (``manifest.py``, ``shard_format: "parquet"``) naming each
file under a root, its rows, size and SHA-256, and the columns read as fields (``parquet_shard.column_kind``).

``index_parquet(urls)`` expands each URL or path (a file, a folder of ``*.parquet``, a glob; local or any fsspec URL:
``s3://bucket/laion/*.parquet``, ``hf://datasets/user/name/data``), reads every file's footer for its rows and
schema (bounded as a reader bounds it) and every byte once for its size and SHA-256, and returns the manifest; the
root is the files' common folder and each shard's name its path under it (``webdataset_index.index_root``, as for
tars). ``stoker data index --parquet`` writes it (``webdataset_index.write_index``).
Files whose columns disagree, a column of a type Stoker does not read (name it out with ``columns``), or no files
at all: DatasetError naming the file and column.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Mapping, Optional, Sequence

import pyarrow.parquet as pq

from stoker.producer.dataset.build.webdataset_index import index_root
from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import Manifest, ShardInfo, parse_manifest
from stoker.producer.dataset.sources.parquet_shard import (MAX_FOOTER_BYTES, NAME, THRIFT_LIMIT, check_row_groups,
                                                           column_kind)

HASH_CHUNK = 8 * 1024 * 1024  # bytes read at a time while hashing


def index_parquet(urls: str | Sequence[str], storage_options: Optional[Mapping[str, Any]] = None,
                  progress: bool = True, columns: Optional[Sequence[str]] = None,
                  classes: Sequence[str] = ()) -> Manifest:
    """The manifest of the Parquet files ``urls`` name (module doc). ``columns``: the columns read as fields, in
    that order (default: every column, each of a type Stoker reads); ``classes``: class names for an int label
    (default none); ``progress``: a line per file on stderr. DatasetError naming what is wrong; OSError from
    storage passes through."""
    from fsspec.core import url_to_fs  # fsspec comes with the object-storage extra; a plain path needs nothing more

    paths, fs = _expand([urls] if isinstance(urls, str) else list(urls), dict(storage_options or {}), url_to_fs)
    where, names = index_root(fs, paths)
    fields: Optional[dict[str, FieldKind]] = None
    shards, first = [], 0
    for number, (path, name) in enumerate(zip(paths, names)):
        with fs.open(path, "rb") as f:
            file_fields, rows = _footer(f, path, columns)
        if fields is None:
            fields = file_fields
        elif file_fields != fields:
            raise DatasetError(f"{path}: columns {_describe(file_fields)} differ from {paths[0]}'s "
                               f"{_describe(fields)}: index files of one schema (or name the columns to read)")
        size, digest = _hash(fs, path)
        shards.append(ShardInfo(name, first, rows, size, digest))
        first += rows
        if progress:
            print(f"indexed {number + 1}/{len(paths)} {name}: {rows} rows, {size / 1e6:.1f} MB", file=sys.stderr)
    assert fields is not None
    meta = DatasetMeta(count=first, fields=fields, classes=tuple(classes), info={"source": "parquet"})
    manifest = Manifest(meta, tuple(shards), NAME, where)
    # the written form parsed back: names, root and counts pass the checks every reader applies
    return parse_manifest(manifest.to_json().encode(), f"the index of {where}")


def _expand(urls: list[str], options: dict, url_to_fs: Any) -> tuple[list[str], Any]:
    """Every file the URLs name, sorted and distinct, on one filesystem."""
    found, fs, protocol = [], None, None
    for url in urls:
        url_fs, path = url_to_fs(url, **options)
        if fs is not None and url_fs.protocol != protocol:
            raise DatasetError(f"{url}: every Parquet file of one index must be on one storage ({protocol})")
        fs, protocol = url_fs, url_fs.protocol
        if any(c in path for c in "*?["):
            matches = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            matches = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
        else:
            matches = [path] if fs.isfile(path) else []
        if not matches:
            raise DatasetError(f"{url}: no Parquet files there (a file, a folder of *.parquet, or a glob)")
        found.extend(matches)
    paths = sorted(set(p.rstrip("/") for p in found))
    return paths, fs


def _footer(f: Any, path: str, columns: Optional[Sequence[str]]) -> tuple[dict[str, FieldKind], int]:
    """The fields a file's columns are read as and its rows, from its footer (bounded, checked)."""
    f.seek(0, 2)
    size = f.tell()
    if size < 12:
        raise DatasetError(f"{path}: {size} bytes is too short for a Parquet file")
    f.seek(size - 8)
    tail = f.read(8)
    if tail[4:] != b"PAR1" or not 0 < int.from_bytes(tail[:4], "little") <= min(MAX_FOOTER_BYTES, size - 12):
        raise DatasetError(f"{path}: not a Parquet file (no PAR1 footer, or one over {MAX_FOOTER_BYTES} bytes)")
    f.seek(0)
    try:
        parquet = pq.ParquetFile(f, thrift_string_size_limit=THRIFT_LIMIT, thrift_container_size_limit=THRIFT_LIMIT,
                                 schema_depth_limit=16, pre_buffer=False)
        schema, metadata = parquet.schema_arrow, parquet.metadata
    except Exception as exc:  # pyarrow's errors for a bad footer are of many classes; each is named
        raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    names = list(columns) if columns else schema.names
    fields = {}
    for name in names:
        index = schema.get_field_index(name)
        if index < 0:
            raise DatasetError(f"{path} has no column {name!r} (it has {', '.join(schema.names)})")
        kind = column_kind(schema.field(index).type)
        if kind is None:
            raise DatasetError(f"{path}: column {name!r} is {schema.field(index).type}, which Stoker does not read "
                               "(it reads the image struct {bytes, path}, binary, string, integers, floats, bool): "
                               "name the columns to read to leave it out")
        fields[name] = FieldKind(kind)
    leaves = {f"{n}.bytes" if k.kind == "image" else n for n, k in fields.items()}
    check_row_groups(metadata, metadata.num_rows, leaves, path)
    return fields, metadata.num_rows


def _hash(fs: Any, path: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _describe(fields: Mapping[str, FieldKind]) -> str:
    return "{" + ", ".join(f"{n}: {k}" for n, k in fields.items()) + "}"
