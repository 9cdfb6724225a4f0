"""``stoker data index|info``: write an index of data left where it lies; describe any source (flags: ``flags.py``).
Each command is a function over the parsed flags that a sibling format (Parquet) extends in a line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from stoker.cli.exit_codes import EXIT_OK
from stoker.cli.lmdb.storage_flags import storage_of


def index_destination(out: str | None, root: str) -> str:
    """Where an index goes: ``out``, else ``manifest.json`` in a local, writable ``root``; ValueError if neither."""
    if out:
        return out
    if "://" not in root and os.access(root, os.W_OK):
        return str(Path(root) / "manifest.json")
    raise ValueError(f"{root} is not a folder this user can write: name the index's file with --out")


def cmd_data_index(args: argparse.Namespace) -> int:
    options = storage_of(args).fsspec_options()
    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    if args.parquet:
        return index_parquet_files(args, options, fields)
    from stoker.producer.dataset.build.webdataset_index import index_webdataset, write_index

    manifest = index_webdataset(args.webdataset, options, progress=not args.quiet, fields=fields)
    out = index_destination(args.out, manifest.root or "")
    write_index(manifest, out, options)
    meta = manifest.meta
    for problem in meta.info.get("problems", []):
        print(f"  passed over: {problem}", file=sys.stderr)
    print(f"indexed {meta.count} samples in {len(manifest.shards)} tars "
          f"({sum(s.bytes for s in manifest.shards) / 1e6:.1f} MB) under {manifest.root}; fields: "
          + ", ".join(f"{n} ({k})" for n, k in meta.fields.items())
          + f"; {meta.info.get('skipped_members', 0)} members passed over. Wrote {out}: serve it with "
          f"`stoker produce --data {out}`")
    return EXIT_OK


def index_parquet_files(args: argparse.Namespace, options: dict, columns: list[str] | None) -> int:
    """``stoker data index --parquet``: the index of Parquet files (``build/parquet_index.py``), written as a tar's."""
    from stoker.producer.dataset.build.parquet_index import index_parquet
    from stoker.producer.dataset.build.webdataset_index import write_index

    manifest = index_parquet(args.parquet, options, progress=not args.quiet, columns=columns)
    out = index_destination(args.out, manifest.root or "")
    write_index(manifest, out, options)
    meta = manifest.meta
    print(f"indexed {meta.count} rows in {len(manifest.shards)} Parquet files "
          f"({sum(s.bytes for s in manifest.shards) / 1e6:.1f} MB) under {manifest.root}; fields: "
          + ", ".join(f"{n} ({k.kind})" for n, k in meta.fields.items())
          + f". Wrote {out}: serve it with `stoker produce --data {out}`")
    return EXIT_OK


def cmd_data_info(args: argparse.Namespace) -> int:
    from stoker.cli.lmdb.commands import cmd_lmdb_info

    return cmd_lmdb_info(args)
