"""The building side of the dataset wing: everything that writes a Stoker dataset. One module per job:

- ``write_records``: ``write_lmdb(path, records)``, the entry point from Python, and the checked write loop every
  builder drives; ``lmdb_writer``: ``DatasetWriter``, one LMDB; ``sharded_writer``: shards and their manifest;
  ``partial_folders``: a build's own folder, published by one rename, so no dataset is ever seen half-built;
- importers (``stoker lmdb build``): ``builder`` (image folders, list files, JSON lines), ``tfrecord_import``,
  ``webdataset_import``; ``synthetic``: deterministic synthetic datasets (``stoker lmdb synth``);
- ``upload``: a sharded dataset copied to object storage (``stoker lmdb upload``); ``build_once``: a dataset built
  once and reused by several processes.

It imports the reading side (``stoker.producer.dataset.sources``: the format it writes), never the reverse.
"""

from __future__ import annotations

from stoker.producer.dataset.build.lmdb_writer import DatasetWriter
from stoker.producer.dataset.build.write_records import WriteReport, write_lmdb

__all__ = ["write_lmdb", "WriteReport", "DatasetWriter"]
