"""``stoker lmdb build|synth|info|upload``: make a dataset, look inside one, put a sharded one in object storage
(docs/format.md). What each subcommand runs; their flags are in ``cli/lmdb/flags.py``.

Each command imports what it needs when it runs, as every ``stoker`` command does.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional, Sequence

from stoker.cli.exit_codes import EXIT_OK
from stoker.cli.lmdb.storage_flags import storage_of

if TYPE_CHECKING:
    from stoker.producer.dataset.sources import RecordSource


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


def _count_labels(ds: "RecordSource") -> tuple[list[int], int]:
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


def _print_per_class(ds: "RecordSource", count: bool) -> None:
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
    from stoker.producer.dataset.sources import RecordError, open_dataset

    with open_dataset(args.path) as ds:
        meta, layout = ds.meta, ds.layout
        print(f"path:     {args.path}")
        if layout is not None:
            shards, kind = layout.shards, "stoker-lmdb" if layout.shard_format == "lmdb" else layout.shard_format
            print(f"format:   stoker-shards version 1: {len(shards)} shard(s) of {kind}, "
                  f"{int(shards.records.min())}-{int(shards.records.max())} records each")
            if layout.root is not None:
                print(f"root:     {layout.root}")
            per = layout.records_per_shard
            if len(shards) > 1:
                print(f"layout:   {per} records per shard: epochs shuffle shard by shard" if per else "layout:   "
                      f"shards of different record counts: epochs shuffle block by block, blocks of "
                      f"{layout.mean_shard_records} records (the mean shard)")
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
    from stoker.cli.shutdown import stop_event_on_signals
    from stoker.producer.dataset.build.upload import upload_dataset

    stop = stop_event_on_signals()  # Ctrl-C and SIGTERM end the retries at once (exit 130, "interrupted")
    shards, size = upload_dataset(args.path, args.url, storage_of(args), overwrite=args.overwrite, cancel=stop)
    print(f"uploaded {shards} shard(s), {size / 1e6:.1f} MB, then the manifest, to {args.url}")
    return EXIT_OK
