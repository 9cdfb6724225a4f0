"""``stoker data index|info``'s flags: data left where it lies (WebDataset tars, Parquet) indexed once and described.

``add_data_parser`` adds the subcommands; ``cli/data/commands.py`` runs them.
"""

from __future__ import annotations

import argparse

from stoker.cli.argument_parser import HelpFormatter
from stoker.cli.data.commands import cmd_data_index, cmd_data_info
from stoker.cli.lmdb.storage_flags import add_storage_arguments


def add_data_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", common: argparse.ArgumentParser) -> None:
    """``stoker data index|info``."""
    data = sub.add_parser("data", parents=[common], help="index data where it lies (WebDataset tars) and describe any "
                          "source", formatter_class=HelpFormatter,
                          description="Serve data without converting it: `stoker data index` reads it once and writes "
                          "an index (a manifest: every shard's samples, size and SHA-256, the fields) that producers "
                          "read with `stoker produce --data INDEX.json`; `stoker data info` describes any source.")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    x = dsub.add_parser("index", parents=[common], formatter_class=HelpFormatter, help="write the index of tar shards or Parquet files",
                        description="Stream every tar once (headers walked, every byte hashed; nothing extracted) and "
                        "write the index. Fields by member extension: jpg/jpeg/png/webp -> image, txt -> text, cls -> "
                        "label, json -> json (a parsed map), any other -> bytes under the extension's name. Members "
                        "passed over (links, folders, too large, a truncated tar's tail) are counted and named. Parquet files: "
                        "every footer read and checked, every byte hashed.")
    kind = x.add_mutually_exclusive_group(required=True)
    kind.add_argument("--webdataset", nargs="+", metavar="URL_OR_GLOB",
                      help="tar shards: files, a folder of them, globs or brace lists as webdataset writes them "
                      "(s3://bucket/train-{000000..000123}.tar), local or at any fsspec URL")
    kind.add_argument("--parquet", nargs="+", metavar="URL_OR_GLOB",
                      help="Parquet files (a file is a shard): files, a folder of *.parquet or globs, local or at any "
                      "fsspec URL (s3://bucket/data/train-*.parquet); columns become fields: the Hugging Face image "
                      "struct -> image, string -> str, binary -> bytes, integer -> int, float, bool")
    x.add_argument("--out", metavar="INDEX.json", default=None,
                   help="where the index goes (default: manifest.json in the tars' common folder, when local)")
    x.add_argument("--fields", default=None, metavar="A,B",
                   help="keep only these fields (e.g. image,text): a tar sample lacking one is skipped and counted "
                   "when read; for Parquet, the columns read (default: every field seen, every column)")
    x.add_argument("--quiet", action="store_true", help="no progress lines")
    add_storage_arguments(x)
    x.set_defaults(func=cmd_data_index)
    i = dsub.add_parser("info", parents=[common], formatter_class=HelpFormatter, help="describe any source",
                        description="What `stoker lmdb info` prints, for any source: an LMDB, a sharded dataset, an "
                        "index of tars or Parquet (its file, or a folder or URL holding manifest.json).")
    i.add_argument("path", metavar="LOCATION", help="an LMDB, an index (INDEX.json), or a folder or URL with manifest.json")
    i.add_argument("--samples", type=int, default=5, help="sample records to show")
    i.add_argument("--count-classes", action="store_true", help="read every record to count the classes where the "
                   "metadata does not")
    i.set_defaults(func=cmd_data_info)
