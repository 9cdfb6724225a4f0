"""``stoker lmdb build|synth|info|upload``'s flags: every argument, default and help text (docs/format.md).

``add_lmdb_parser`` adds the subcommands; ``cli/lmdb/commands.py`` runs them.
"""

from __future__ import annotations

import argparse

from stoker.cli.argument_parser import HelpFormatter, positive_int, size_argument
from stoker.cli.lmdb.commands import cmd_lmdb_build, cmd_lmdb_info, cmd_lmdb_synth, cmd_lmdb_upload
from stoker.cli.lmdb.storage_flags import add_storage_arguments


def add_lmdb_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", common: argparse.ArgumentParser) -> None:
    """``stoker lmdb build|synth|info|upload``."""
    lmdb = sub.add_parser("lmdb", parents=[common], help="build and inspect Stoker LMDB datasets", formatter_class=HelpFormatter,
                          description="Build and inspect datasets in the Stoker LMDB format (docs/format.md).")
    lsub = lmdb.add_subparsers(dest="lmdb_command", required=True, metavar="ACTION")
    b = lsub.add_parser("build", parents=[common], formatter_class=HelpFormatter, help="build an LMDB from an image folder or list file",
                        description="Build an LMDB from SRC: a folder with one sub-folder per class (ImageNet train layout; files in "
                        "nested sub-folders of a class folder belong to that class) or a list file of `path label` lines. Images are "
                        "recognised by content (JPEG, PNG, WebP, BMP, GIF, TIFF) and stored as they are, after a check with the producers' "
                        "decoder. Every file not stored (not an image, over 8192x8192 pixels, corrupt, unreadable, outside a class folder) "
                        "is named once, by path, with the reason, and counted. A class folder left with no image is an error that names "
                        "it (see --allow-empty-classes). Ends with the records per class. The result appears at OUT only when complete.")
    b.add_argument("src", help="image folder (SRC/<class>/<files>), list file, or with --jsonl a JSON-lines file")
    b.add_argument("out", help="output LMDB directory")
    b.add_argument("--from", dest="source_format", choices=("files", "webdataset", "tfrecord"), default="files",
                   help="files: SRC is a folder, a list file or (--jsonl) JSON lines; webdataset: SRC is WebDataset "
                   "tar shards (a tar, a folder of them, or a URL or glob such as s3://bucket/train-*.tar), each "
                   "sample's image and .cls label stored, every sample or member left out named; tfrecord: SRC is "
                   "TFRecord files of tf.train.Example (a file, a folder of them, or a URL or glob such as "
                   "s3://bucket/train-*), read without TensorFlow, frames checked by their CRC, each Example's image "
                   "and label features stored (--image-key, --label-key), every one left out named")
    b.add_argument("--image-key", default="image/encoded",
                   help="--from tfrecord: the bytes feature holding the encoded image")
    b.add_argument("--label-key", default="image/class/label",
                   help="--from tfrecord: the int64 feature holding the class index (stored as it is: 1-based "
                   "labels, as TensorFlow's ImageNet script writes, leave class 0 empty)")
    b.add_argument("--jsonl", action="store_true",
                   help="SRC is JSON lines: one object per line, image fields holding paths relative to SRC's folder, "
                   "other fields stored as their JSON values (e.g. {\"image\": \"a.jpg\", \"boxes\": [[x1, y1, "
                   "x2, y2]], \"classes\": [3]})")
    b.add_argument("--image-field", action="append", metavar="NAME",
                   help="with --jsonl: a field holding an image path (repeatable; default: image)")
    b.add_argument("--task", default="", help="task name stored in the metadata (e.g. detection)")
    b.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    b.add_argument("--threads", type=positive_int, default=None, help="threads that verify images (default: CPU count)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--allow-empty-classes", action="store_true", help="keep a class folder with no image (empty, or every file "
                   "skipped) as a class with 0 records, with a warning, instead of refusing the build; without it, remove the folder")
    b.add_argument("--shard-size", type=size_argument, default=None, metavar="SIZE",
                   help="write a sharded dataset: shards of about SIZE (e.g. 256MB, 1GiB) and a manifest, for object "
                   "storage (stoker lmdb upload; docs/format.md). Default: one LMDB")
    add_storage_arguments(b)
    b.set_defaults(func=cmd_lmdb_build)
    s = lsub.add_parser("synth", parents=[common], formatter_class=HelpFormatter, help="make a deterministic synthetic JPEG dataset",
                        description="Write COUNT photo-like synthetic records (JPEGs of 300-500 px) for demos, tests "
                        "and benchmarks, for a classification, detection or segmentation task. Same --seed, same bytes.")
    s.add_argument("out", help="output LMDB directory")
    s.add_argument("--count", type=positive_int, default=1000, help="number of images")
    s.add_argument("--seed", type=int, default=0, help="generator seed")
    s.add_argument("--classes", type=positive_int, default=10, help="number of classes")
    s.add_argument("--task", choices=("classification", "detection", "segmentation"), default="classification",
                   help="classification: image + label; detection: image + boxes + classes of the drawn objects; "
                   "segmentation: image + a PNG mask of the drawn shapes")
    s.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    s.add_argument("--exist-ok", action="store_true", help="do nothing if OUT already holds a Stoker dataset")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--shard-size", type=size_argument, default=None, metavar="SIZE",
                   help="write a sharded dataset of shards of about SIZE (e.g. 64MB) for object storage")
    s.set_defaults(func=cmd_lmdb_synth)
    i = lsub.add_parser("info", parents=[common], formatter_class=HelpFormatter, help="describe an LMDB",
                        description="Print record count, classes, format version, size, a few sample records and the records per class.")
    i.add_argument("path", help="LMDB directory")
    i.add_argument("--samples", type=int, default=5, help="sample records to show")
    i.add_argument("--count-classes", action="store_true", help="for a dataset built without per-class counts: read every record to count them")
    i.set_defaults(func=cmd_lmdb_info)
    u = lsub.add_parser("upload", parents=[common], formatter_class=HelpFormatter,
                        help="copy a sharded dataset to object storage",
                        description="Copy a sharded dataset (stoker lmdb build --shard-size) to URL (s3://bucket/prefix, "
                        "or any fsspec URL): every shard, checked against the manifest first, then the manifest last, "
                        "so a reader never sees a manifest whose shards are not all there. Credentials come from the "
                        "storage library's usual chain (for S3: AWS_* variables, ~/.aws files, instance roles).")
    u.add_argument("path", help="the sharded dataset's folder")
    u.add_argument("url", help="where to put it, e.g. s3://bucket/datasets/train")
    u.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at URL: its manifest is removed first, so no producer starts on "
                   "half-replaced shards; restart producers that were reading it")
    add_storage_arguments(u)
    u.set_defaults(func=cmd_lmdb_upload)
