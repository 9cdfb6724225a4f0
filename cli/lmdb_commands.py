"""``stoker lmdb build|synth|info``: make a dataset and look inside one (docs/format.md).

Each command imports what it needs when it runs, as every ``stoker`` command does.
"""

from __future__ import annotations

import argparse

from stoker.cli.exit_codes import EXIT_OK


def cmd_lmdb_build(args: argparse.Namespace) -> int:
    from stoker.producer.dataset.build import build_lmdb

    report = build_lmdb(args.src, args.out, overwrite=args.overwrite, threads=args.threads, progress=not args.quiet,
                        jsonl=args.jsonl, image_fields=args.image_field or ["image"], task=args.task)
    meta = report.meta
    classes = f" in {len(meta.classes)} classes" if meta.classes else ""
    for path, reason in report.skipped:
        print(f"  skipped {path}: {reason}")
    fields = ", ".join(f"{name} ({kind})" for name, kind in meta.fields.items())
    source = "declared by the build" if report.schema_from == "declared" else f"inferred from {report.schema_from}"
    print(f"fields: {fields} ({source})")
    for warning in report.warnings:
        print(f"warning: {warning}")
    print(f"wrote {meta.count} records{classes} to {args.out}; skipped {len(report.skipped)} "
          f"{'lines' if args.jsonl else 'files'}")
    return EXIT_OK


def cmd_lmdb_synth(args: argparse.Namespace) -> int:
    from stoker.producer.dataset.synthetic import build_synthetic

    def build(out: object) -> None:
        meta = build_synthetic(out, args.count, seed=args.seed, num_classes=args.classes,  # type: ignore[arg-type]
                               overwrite=args.overwrite or args.exist_ok, progress=not args.quiet, task=args.task)
        print(f"wrote {meta.count} synthetic {args.task} records in {len(meta.classes)} classes to {args.out}")

    if not args.exist_ok:
        build(args.out)
        return EXIT_OK
    from stoker.producer.dataset.cache import cached_dataset
    from stoker.producer.dataset.format import DatasetError, LmdbDataset

    def usable(out: object) -> bool:
        try:
            with LmdbDataset(out) as ds:  # type: ignore[arg-type]
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


def cmd_lmdb_info(args: argparse.Namespace) -> int:
    from stoker.producer.dataset.format import LmdbDataset, RecordError

    with LmdbDataset(args.path) as ds:
        meta = ds.meta
        print(f"path:     {args.path}")
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
    return EXIT_OK
