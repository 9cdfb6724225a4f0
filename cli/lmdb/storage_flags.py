"""How to reach object storage: the flags ``stoker produce``, ``lmdb build`` and ``lmdb upload`` share, and the
``RemoteOptions`` they make."""

from __future__ import annotations

import argparse

from stoker.cli.argument_parser import key_value


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
