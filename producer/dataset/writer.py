"""``stoker.producer.dataset.writer``, the path README and docs/format.md named before the dataset wing was split
into ``sources/`` and ``build/`` (issue 40): kept so users' code that imports it keeps working. The writers live
in ``stoker.producer.dataset.build``; import them from there.
"""

from stoker.producer.dataset.build import DatasetWriter, WriteReport, write_lmdb

__all__ = ["write_lmdb", "WriteReport", "DatasetWriter"]
