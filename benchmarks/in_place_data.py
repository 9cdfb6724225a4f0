"""The same image-caption records written three ways, for ``in_place.py``: sharded Stoker LMDB, WebDataset tars
as img2dataset writes them (``NNNNNNNNN.jpg`` / ``.txt`` / ``.json``) and Parquet files as a Hugging Face image
dataset is (an image struct ``{bytes, path}`` beside a ``text`` string column, row groups of 100 rows), each with
about the same number of shards. Then the tars and Parquet files are indexed (``index_webdataset``,
``index_parquet``) as ``stoker data index`` would, locally or where they were uploaded.

- ``caption_records``: ``count`` synthetic JPEGs (smooth colour fields with noise, about ``side`` px, seed 0) and
  captions of 20 to 120 bytes (some longer than CLIP's 77);
- ``write_sources``: the three copies under a folder; ``SourceFiles`` says where each is;
- ``upload_sources``: the three copies put in a bucket of a ``LocalS3``; ``index_sources``: the indexes written.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

WORDS = ("a photo of the dog cat red blue small large house tree river city night street old new man woman car "
         "boat on in with near under painting drawing close-up view beach mountain snow field bird flower").split()
GROUP_ROWS = 100  # the Hugging Face datasets library's row groups for image datasets


def caption_records(count: int, side: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` records ``{"image": JPEG bytes, "text": str}``; sides vary +-25% around ``side``."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        h, w = (int(side * rng.uniform(0.75, 1.25)) for _ in range(2))
        field = cv2.resize(rng.integers(0, 256, (6, 6, 3), np.uint8), (w, h), interpolation=cv2.INTER_CUBIC)
        noisy = np.clip(field.astype(np.int16) + rng.integers(-12, 13, (h, w, 3)), 0, 255).astype(np.uint8)
        ok, jpeg = cv2.imencode(".jpg", noisy, [cv2.IMWRITE_JPEG_QUALITY, 90])
        assert ok
        words = rng.choice(WORDS, int(rng.integers(4, 22)))
        records.append({"image": jpeg.tobytes(), "text": " ".join(words)[:120]})
    return records


@dataclass(frozen=True)
class SourceFiles:
    """Where the copies are: the sharded LMDB folder, the tar folder, the Parquet folder."""

    lmdb: Path
    tars: Path
    parquet: Path


def write_sources(folder: Path, records: list[dict[str, Any]], shards: int) -> SourceFiles:
    """The records as ``shards`` LMDB shards (about), ``shards`` tars and ``shards`` Parquet files under ``folder``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stoker.producer.dataset.build.write_records import write_lmdb

    files = SourceFiles(folder / "lmdb", folder / "tars", folder / "parquet")
    total = sum(len(r["image"]) + len(r["text"]) for r in records)
    write_lmdb(files.lmdb, records, schema={"image": "image", "text": "str"}, progress=False,
               shard_bytes=max(1, total // shards + 1), check_images=False)
    files.tars.mkdir()
    files.parquet.mkdir()
    per = -(-len(records) // shards)
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("text", pa.string())])
    for s in range(shards):
        part = list(enumerate(records))[s * per:(s + 1) * per]
        with tarfile.open(files.tars / f"{s:06d}.tar", "w") as tar:
            for n, record in part:
                key = f"{n:09d}"
                meta = {"key": key, "caption": record["text"], "url": f"https://example.com/{key}.jpg",
                        "status": "success"}
                for ext, data in (("jpg", record["image"]), ("txt", record["text"].encode()),
                                  ("json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime = len(data), 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
        rows = [{"image": {"bytes": r["image"], "path": f"{n:09d}.jpg"}, "text": r["text"]} for n, r in part]
        pq.write_table(pa.Table.from_pylist(rows, schema=schema),
                       files.parquet / f"train-{s:05d}-of-{shards:05d}.parquet", row_group_size=GROUP_ROWS)
    return files


def upload_sources(files: SourceFiles, s3: Any, prefix: str) -> dict[str, str]:
    """The three copies put under ``s3://BUCKET/PREFIX/``; their URLs by source (``lmdb`` by ``stoker lmdb upload``)."""
    from harness import run_stoker

    base = f"s3://{s3.bucket}/{prefix}"
    run_stoker("lmdb", "upload", str(files.lmdb), f"{base}/lmdb", "--s3-endpoint", s3.endpoint, env=s3.environment())
    fs = s3.fs()
    for name in ("tars", "parquet"):
        for path in sorted(getattr(files, name).iterdir()):
            fs.put(str(path), f"{base}/{name}/{path.name}")
    return {"lmdb": f"{base}/lmdb", "tar": f"{base}/tars", "parquet": f"{base}/parquet"}


def index_sources(tars: str, parquet: str, out: Path, storage_options: dict | None = None) -> dict[str, str]:
    """The indexes of the tars and Parquet files at ``tars`` and ``parquet`` (folders or URLs) written as
    ``out``-tar.json and ``out``-parquet.json; their paths by source."""
    from stoker.producer.dataset.build.parquet_index import index_parquet
    from stoker.producer.dataset.build.webdataset_index import index_webdataset

    written = {}
    # The fields the LMDB copy holds (image, text): the tars' .json metadata is left out of the index, as a job that
    # does not use it would (`stoker data index --fields image,text`), so every source serves the same records.
    for source, manifest in (("tar", index_webdataset([f"{tars}/*.tar"], storage_options, progress=False,
                                                      fields=["image", "text"])),
                             ("parquet", index_parquet(f"{parquet}/*.parquet", storage_options, progress=False))):
        path = out.with_name(f"{out.name}-{source}.json")
        path.write_text(manifest.to_json())
        written[source] = str(path)
    return written
