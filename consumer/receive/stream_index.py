"""The producers' streams indexed by what can make two of them overlap: ``StreamIndex``, for ``ReceiveStats``.

Two producers' streams can repeat records within an epoch (``stats.shard_conflict``) only if they name a dataset
of the same size and one of: one is an elastic pool's and the other a fixed shard; their shard counts or dataset
blocks differ; or they serve the same shard with the same seed. ``candidates`` names only the producers for which
one of those holds, so a trainer reading 1,024 well-configured fixed shards checks none of the others when a
producer's first batch names its stream (comparing with every producer made the set-up quadratic: seconds at
1,024 producers). Not thread-safe: ``ReceiveStats`` calls it under its lock.
"""

from __future__ import annotations

from typing import Optional

from stoker.protocol.input_state import StreamKey

_Shape = tuple[int, int]  # (shard count, dataset block) of a fixed shard
_Place = tuple[int, int, int, int]  # (count, block, index, seed)


class _SameSize:
    """The producers whose streams name datasets of one size: pool members, fixed shards by shape and by place.
    Dicts as insertion-ordered sets, so candidates come in the order producers were first seen."""

    def __init__(self) -> None:
        self.pool: dict[str, None] = {}
        self.by_shape: dict[_Shape, dict[str, None]] = {}
        self.by_place: dict[_Place, dict[str, None]] = {}


class StreamIndex:
    """See the module doc. ``put(producer, stream)`` records (or moves) a producer's stream; ``candidates`` are the
    other producers ``stats.shard_conflict`` may find overlapping with it (a superset: it decides)."""

    def __init__(self) -> None:
        self._sizes: dict[int, _SameSize] = {}
        self._key: dict[str, StreamKey] = {}

    def put(self, producer: str, stream: str) -> None:
        """``producer`` serves ``stream`` now (a stream that does not parse is not indexed: it overlaps nothing)."""
        self._drop(producer)
        try:
            key = StreamKey.parse(stream)
        except ValueError:
            return
        self._key[producer] = key
        same = self._sizes.setdefault(key.records, _SameSize())
        if key.splits:
            same.pool[producer] = None
        else:
            same.by_shape.setdefault((key.count, key.block), {})[producer] = None
            same.by_place.setdefault((key.count, key.block, key.index, key.seed), {})[producer] = None

    def candidates(self, producer: str) -> list[str]:
        """Producers (not ``producer``) whose streams may overlap ``producer``'s, in the order they were first put."""
        key: Optional[StreamKey] = self._key.get(producer)
        same = self._sizes.get(key.records) if key is not None else None
        if key is None or same is None:
            return []
        if key.splits:
            found = [p for members in same.by_shape.values() for p in members]
        else:
            shape = (key.count, key.block)
            found = list(same.pool)
            found += [p for other, members in same.by_shape.items() if other != shape for p in members]
            found += list(same.by_place.get((key.count, key.block, key.index, key.seed), ()))
        return [p for p in found if p != producer]

    def _drop(self, producer: str) -> None:
        key = self._key.pop(producer, None)
        if key is None:
            return
        same = self._sizes[key.records]
        same.pool.pop(producer, None)
        for table, at in ((same.by_shape, (key.count, key.block)),
                          (same.by_place, (key.count, key.block, key.index, key.seed))):
            members = table.get(at)  # type: ignore[call-overload]
            if members is not None:
                members.pop(producer, None)
                if not members:
                    del table[at]  # type: ignore[arg-type]
