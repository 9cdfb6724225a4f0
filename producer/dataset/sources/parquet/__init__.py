"""Parquet shards' parts below the format itself (``sources/parquet_shard.py``, the registry's entry): ``decoded``,
a shard's row groups as decoded Arrow arrays with each row's byte size, and the least-recently-used cache of them
that each dataset owns (``DecodedGroups``).
"""
