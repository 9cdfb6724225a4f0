"""``stoker lmdb upload``: a sharded dataset copied to object storage, manifest last.

Every shard's ``data.mdb`` is checked against the manifest (size and SHA-256) before anything is sent, so a
corrupt local copy is never published and leaves the bucket as it was; shards go first and the manifest last, so a reader that finds the manifest finds
every shard it names. Over a dataset already there only with ``overwrite``, and then its manifest goes first: no
producer starting meanwhile reads a manifest whose shards are being replaced (one already running, pinned to the old
manifest, refuses the replaced shards by their SHA-256 and skips their records, counted, until it is restarted).
Each call is retried like a fetch (``storage_retry.retried``): an error that cannot heal (no credentials, refused
ones, no such bucket) fails at once naming the fix; a set ``cancel`` (the CLI's signals) stops at once
(StorageCancelled). DatasetError naming what is wrong.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from stoker.producer.dataset.sources.lmdb_format import DatasetError
from stoker.producer.dataset.sources.object_storage import storage
from stoker.producer.dataset.build.sharded_writer import file_sha256
from stoker.producer.dataset.sources.manifest import MANIFEST, parse_manifest
from stoker.producer.dataset.sources.object_storage import RemoteOptions
from stoker.producer.dataset.sources.sharded import ShardUnavailable
from stoker.producer.dataset.sources.storage_retry import retried


def upload_dataset(path: str | os.PathLike, url: str, remote: RemoteOptions = RemoteOptions(),
                   progress: bool = True, overwrite: bool = False,
                   cancel: Optional[threading.Event] = None) -> tuple[int, int]:
    """Copy the sharded dataset at ``path`` to ``url``; ``(shards, bytes)`` sent. StorageCancelled once ``cancel``
    is set (the bucket may then hold some shards, never a manifest naming a missing one)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise DatasetError(f"{path} is not a sharded dataset (no {MANIFEST}): build one with "
                           "`stoker lmdb build SRC OUT --shard-size 256MB`")
    manifest_bytes = (path / MANIFEST).read_bytes()
    manifest = parse_manifest(manifest_bytes, str(path / MANIFEST))
    for shard in tqdm(manifest.shards, desc="check", unit="shard", disable=not progress):  # before the bucket changes
        local = path / shard.name / "data.mdb"
        if not local.is_file() or local.stat().st_size != shard.bytes or file_sha256(local) != shard.sha256:
            raise DatasetError(f"{local} does not match the manifest (missing, or other size or SHA-256): rebuild "
                               "the dataset")
    fs, root = storage(url, remote.fsspec_options())
    root = root.rstrip("/")
    try:
        existing = retried(f"looking for a dataset at {url}", lambda: fs.exists(f"{root}/{MANIFEST}"),
                           remote.retry_seconds, cancel)
        if existing and not overwrite:
            raise DatasetError(f"a dataset is already at {url} ({MANIFEST} is there): pass --overwrite to replace it "
                               "(its manifest is removed first; restart the producers reading it afterwards)")
        if existing:
            retried(f"removing the old {MANIFEST} at {url}", lambda: fs.rm(f"{root}/{MANIFEST}"), remote.retry_seconds,
                    cancel)
    except ShardUnavailable as exc:
        raise DatasetError(str(exc)) from None
    sent = 0
    for shard in tqdm(manifest.shards, desc="upload", unit="shard", disable=not progress):
        local = path / shard.name / "data.mdb"
        try:
            retried(f"uploading {local} to {url}", lambda: fs.put_file(str(local), f"{root}/{shard.name}/data.mdb"),
                    remote.retry_seconds, cancel)
        except ShardUnavailable as exc:
            raise DatasetError(str(exc)) from None
        sent += shard.bytes

    def put_manifest() -> None:
        with fs.open(f"{root}/{MANIFEST}", "wb") as out:
            out.write(manifest_bytes)
    try:
        retried(f"uploading {MANIFEST} to {url}", put_manifest, remote.retry_seconds, cancel)
    except ShardUnavailable as exc:
        raise DatasetError(str(exc)) from None
    return len(manifest.shards), sent
