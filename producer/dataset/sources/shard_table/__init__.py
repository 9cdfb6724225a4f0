"""A manifest's shards as columns (issue 42, web scale): ``table.ShardTable`` holds 10^6 shards in NumPy arrays (about
90 bytes a shard, not a Python object per field); ``columns`` checks the columns a manifest's JSON gave, vectorised;
``compact`` is the binary form a producer daemon hands its workers, so none re-parses the JSON."""
