"""``stoker lmdb build|synth|info|upload``: make a dataset, look inside one, put a sharded one in object storage
(docs/format.md): the subcommands' arguments (``add_lmdb_parser``) and what they run.

Each command imports what it needs when it runs, as every ``stoker`` command does.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from stoker.cli.argument_parser import HelpFormatter, key_value, positive_int
from stoker.cli.exit_codes import EXIT_OK

if TYPE_CHECKING:
    from stoker.producer.dataset.sources import LmdbDataset


def size_argument(text: str) -> int:
    from stoker.producer.dataset.build.sharded_writer import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_lmdb_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", common: argparse.ArgumentParser,
                    handlers: Mapping[str, Callable[[argparse.Namespace], int]]) -> None:
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
    b.set_defaults(func=handlers["lmdb_build"])
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
    s.set_defaults(func=handlers["lmdb_synth"])
    i = lsub.add_parser("info", parents=[common], formatter_class=HelpFormatter, help="describe an LMDB",
                        description="Print record count, classes, format version, size, a few sample records and the records per class.")
    i.add_argument("path", help="LMDB directory")
    i.add_argument("--samples", type=int, default=5, help="sample records to show")
    i.add_argument("--count-classes", action="store_true", help="for a dataset built without per-class counts: read every record to count them")
    i.set_defaults(func=handlers["lmdb_info"])
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
    u.set_defaults(func=handlers["lmdb_upload"])


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """How to reach object storage: shared by ``stoker produce`` and ``stoker lmdb upload``."""
    parser.add_argument("--s3-endpoint", metavar="URL", default=None,
                        help="an S3-compatible server (MinIO, SeaweedFS, Ceph), e.g. http://minio:9000 (default: AWS)")
    parser.add_argument("--storage-option", type=key_value, action="append", metavar="KEY=VALUE", default=None,
                        help="an fsspec storage option for the URL's filesystem (repeatable; values are never "
                        "logged), e.g. anon=true")


def storage_of(args: argparse.Namespace, **more: object):
    """The ``RemoteOptions`` of ``add_storage_arguments``' flags (``more``: a producer's cache flags)."""
    from stoker.producer.dataset.sources import RemoteOptions

    return RemoteOptions(storage_options=tuple(args.storage_option or ()), s3_endpoint=args.s3_endpoint,
                         **more)  # type: ignore[arg-type]


def cmd_lmdb_build(args: argparse.Namespace) -> int:
    from stoker.producer.dataset.build.builder import build_lmdb

    report = build_lmdb(args.src, args.out, overwrite=args.overwrite, threads=args.threads, progress=not args.quiet,
                        jsonl=args.jsonl, image_fields=args.image_field or ["image"], task=args.task,
                        allow_empty_classes=args.allow_empty_classes, shard_bytes=args.shard_size,
                        source_format=args.source_format, storage_options=storage_of(args).fsspec_options(),
                        tfrecord_keys=(args.image_key, args.label_key))
    meta = report.meta
    classes = f" in {len(meta.classes)} classes" if meta.classes else ""
    if args.quiet:  # with the progress bar the build named each one as it found it, once
        for path, reason in report.skipped:
            print(f"  skipped {path}: {reason}")
    fields = ", ".join(f"{name} ({kind})" for name, kind in meta.fields.items())
    source = "declared by the build" if report.schema_from == "declared" else f"inferred from {report.schema_from}"
    print(f"fields: {fields} ({source})")
    for warning in report.warnings:
        print(f"warning: {warning}")
    if meta.class_counts is not None:
        print(_per_class(meta.classes, meta.class_counts, limit=_BUILD_CLASS_LINES, lmdb=args.out))
    listed = " (listed above)" if report.skipped else ""
    print(f"wrote {meta.count} records{classes} to {args.out}; skipped {len(report.skipped)} "
          f"{'lines' if args.jsonl else 'files' if args.source_format == 'files' else 'samples'}{listed}")
    return EXIT_OK


_BUILD_CLASS_LINES = 20  # more classes: the build summary gives the spread, `stoker lmdb info` every class


def _per_class(classes: Sequence[str], counts: Sequence[int], limit: Optional[int] = None, lmdb: str = "",
               title: str = "records per class") -> str:
    """Records per class, a line each (up to ``limit`` classes; above it min, median and max)."""
    if limit is not None and len(classes) > limit:
        order = sorted(range(len(counts)), key=lambda label: (counts[label], label))
        least, most = order[0], order[-1]
        return (f"{title}: min {counts[least]} ({classes[least]}), median {sorted(counts)[len(counts) // 2]}, "
                f"max {counts[most]} ({classes[most]}); `stoker lmdb info {lmdb}` lists every class")
    width, digits = max(len(name) for name in classes), len(str(max(counts)))
    return f"{title}:\n" + "\n".join(f"  {name:<{width}}  {count:>{digits}}" for name, count in zip(classes, counts))


def cmd_lmdb_synth(args: argparse.Namespace) -> int:
    from stoker.producer.dataset.build.synthetic import build_synthetic

    def build(out: object) -> None:
        meta = build_synthetic(out, args.count, seed=args.seed, num_classes=args.classes,  # type: ignore[arg-type]
                               overwrite=args.overwrite or args.exist_ok, progress=not args.quiet, task=args.task,
                               shard_bytes=args.shard_size)
        print(f"wrote {meta.count} synthetic {args.task} records in {len(meta.classes)} classes to {args.out}")

    if not args.exist_ok:
        build(args.out)
        return EXIT_OK
    from stoker.producer.dataset.build.build_once import cached_dataset
    from stoker.producer.dataset.sources import DatasetError, open_dataset

    def usable(out: object) -> bool:
        try:
            with open_dataset(out) as ds:  # type: ignore[arg-type]
                print(f"{args.out} already holds a Stoker dataset of {len(ds)} records; leaving it")
                return True
        except DatasetError:
            return False

    # Several containers or jobs may run this at once (compose): one builds, the others wait for it.
    cached_dataset(args.out, build, usable)
    return EXIT_OK


def _describe_value(value: object) -> str:
    import numpy as np

    from stoker.producer.images.decode import DecodeError, read_image_info, sniff_format

    if isinstance(value, bytes):
        if sniff_format(value) is None:
            return f"{len(value)} bytes"
        try:  # the header only: fast, and safe against decompression bombs
            info = read_image_info(value)
            return f"{info.format} {len(value) / 1e3:.1f} KB {info.width}x{info.height}"
        except DecodeError as exc:
            return f"UNDECODABLE ({exc})"
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count_labels(ds: "LmdbDataset") -> tuple[list[int], int]:
    """Records per class counted by reading every record, and how many records could not be read."""
    from tqdm import tqdm

    from stoker.producer.dataset.sources import RecordError

    counts, unreadable = [0] * len(ds.meta.classes), 0
    for index in tqdm(range(len(ds)), desc="count", unit="rec", disable=None):  # a bar on terminals only
        try:
            label = ds.read(index)["label"]
        except RecordError:
            unreadable += 1
            continue
        if 0 <= label < len(counts):
            counts[label] += 1
        else:
            unreadable += 1
    return counts, unreadable


def _print_per_class(ds: "LmdbDataset", count: bool) -> None:
    """The stored per-class counts; for a dataset built without them, counted (``count``) or said unknown."""
    meta = ds.meta
    if not meta.classes or getattr(meta.fields.get("label"), "kind", "") != "int":
        return  # per-class record counts need one int label per record (not so for detection, say)
    if meta.class_counts is not None:
        print(_per_class(meta.classes, meta.class_counts))
    elif count:
        counts, unreadable = _count_labels(ds)
        print(_per_class(meta.classes, counts, title="records per class (counted now)"))
        if unreadable:
            print(f"  {unreadable} record(s) unreadable or with a label outside the classes")
    else:
        print("records per class: unknown (built before Stoker stored them in the metadata); "
              "--count-classes counts them by reading every record, or rebuild the dataset")


def cmd_lmdb_info(args: argparse.Namespace) -> int:
    from stoker.producer.dataset.sources import RecordError, ShardedDataset, open_dataset

    with open_dataset(args.path) as ds:
        meta = ds.meta
        print(f"path:     {args.path}")
        if isinstance(ds, ShardedDataset):
            shards = ds.manifest.shards
            print(f"format:   stoker-shards version 1: {len(shards)} shard(s) of stoker-lmdb, "
                  f"{min(s.records for s in shards)}-{max(s.records for s in shards)} records each")
            per = ds.manifest.records_per_shard
            if len(shards) > 1:
                print(f"layout:   {per} records per shard: epochs shuffle shard by shard" if per else "layout:   "
                      "shards of different record counts: epochs are flat shuffles (rebuild to go shard by shard)")
        else:
            print(f"format:   stoker-lmdb version {meta.version}")
        print(f"records:  {meta.count}")
        if meta.task:
            print(f"task:     {meta.task}")
        print("fields:   " + ", ".join(f"{name} ({kind})" for name, kind in meta.fields.items()))
        if meta.classes:
            print(f"classes:  {len(meta.classes)} ({', '.join(meta.classes[:8])}{', ...' if len(meta.classes) > 8 else ''})")
        print(f"size:     {ds.size_bytes() / 1e6:.1f} MB on disk")
        step = max(1, meta.count // max(1, args.samples))
        for index in range(0, meta.count, step)[: args.samples]:
            try:
                record = ds.read(index)
            except RecordError as exc:
                print(f"  {index:08d}: CORRUPT ({exc})")
                continue
            fields = []
            for name, value in record.items():
                described = _describe_value(value)
                if name == "label" and meta.classes and isinstance(value, int) and 0 <= value < len(meta.classes):
                    described += f" ({meta.classes[value]})"
                fields.append(f"{name}: {described}")
            print(f"  {index:08d}: " + ", ".join(fields))
        _print_per_class(ds, args.count_classes)
    return EXIT_OK


def cmd_lmdb_upload(args: argparse.Namespace) -> int:
    from stoker.cli.main import stop_event_on_signals
    from stoker.producer.dataset.build.upload import upload_dataset

    stop = stop_event_on_signals()  # Ctrl-C and SIGTERM end the retries at once (exit 130, "interrupted")
    shards, size = upload_dataset(args.path, args.url, storage_of(args), overwrite=args.overwrite, cancel=stop)
    print(f"uploaded {shards} shard(s), {size / 1e6:.1f} MB, then the manifest, to {args.url}")
    return EXIT_OK
