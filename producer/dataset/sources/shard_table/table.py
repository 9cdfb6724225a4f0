"""``ShardTable``: a manifest's shards as arrays, read as a ``Sequence[ShardInfo]`` made on demand.

A web-scale index lists 10^6 tars; a ShardInfo dataclass with its name and SHA-256 strings per shard cost ~800 MB in
every producer process. Here a shard is its row in four arrays and a slice of one names blob: ~90 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union, overload

import numpy as np

__all__ = ["ShardInfo", "ShardTable"]


@dataclass(frozen=True)
class ShardInfo:
    name: str
    first: int  # global index of its first record
    records: int
    bytes: int  # size of its object (an LMDB shard's data.mdb)
    sha256: str


class ShardTable(Sequence[ShardInfo]):
    """Shards ``0..n-1``: ``records``, ``bytes`` and ``first`` (int64), ``sha256`` (n x 32 uint8), names as one ASCII
    blob cut at ``name_ends`` (int64, n). Immutable by contract (its arrays are made read-only). Indexing makes a
    ``ShardInfo``; a slice makes a tuple of them."""

    __slots__ = ("names", "name_ends", "records", "bytes", "sha256", "first", "_sha_order")

    def __init__(self, names: bytes, name_ends: np.ndarray, records: np.ndarray, sizes: np.ndarray,
                 sha256: np.ndarray) -> None:
        self.names, self.name_ends = names, np.asarray(name_ends, np.int64)
        self.records, self.bytes = np.asarray(records, np.int64), np.asarray(sizes, np.int64)
        self.sha256 = np.asarray(sha256, np.uint8).reshape(-1, 32)
        self.first = np.cumsum(self.records) - self.records
        for array in (self.name_ends, self.records, self.bytes, self.sha256, self.first):
            array.flags.writeable = False
        self._sha_order: Optional[np.ndarray] = None  # shard numbers sorted by SHA-256, made on first lookup

    @classmethod
    def of(cls, shards: Sequence[ShardInfo]) -> "ShardTable":
        """The table of ``shards`` (a ShardTable is returned as is); each ``first`` is recomputed from the records.
        ValueError for a name not ASCII or a SHA-256 not 64 hex digits."""
        if isinstance(shards, ShardTable):
            return shards
        names = [s.name.encode("ascii") for s in shards]
        digests = b"".join(bytes.fromhex(s.sha256) for s in shards)
        if len(digests) != 32 * len(shards):
            raise ValueError("a shard's sha256 is not 64 hex digits")
        return cls(b"".join(names), np.cumsum([len(n) for n in names], dtype=np.int64),
                   np.array([s.records for s in shards], np.int64), np.array([s.bytes for s in shards], np.int64),
                   np.frombuffer(digests, np.uint8))

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[ShardInfo, ...]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[ShardInfo, tuple[ShardInfo, ...]]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"shard {i} of {n}")
        start = int(self.name_ends[j - 1]) if j else 0
        return ShardInfo(self.names[start:int(self.name_ends[j])].decode("ascii"), int(self.first[j]),
                         int(self.records[j]), int(self.bytes[j]), self.sha256[j].tobytes().hex())

    def __iter__(self) -> Iterator[ShardInfo]:
        return (self[j] for j in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable):
            return (self.names == other.names and np.array_equal(self.name_ends, other.name_ends)
                    and np.array_equal(self.records, other.records) and np.array_equal(self.bytes, other.bytes)
                    and np.array_equal(self.sha256, other.sha256))
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.names, self.records.tobytes(), self.sha256.tobytes()))

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} shards)"

    def number_of_sha(self, sha256_hex: str) -> Optional[int]:
        """The shard whose object has SHA-256 ``sha256_hex`` (any of them where several share it), None for none or
        for text that is not 64 lowercase hex digits. A binary search over the digests, sorted once."""
        if len(sha256_hex) != 64 or sha256_hex != sha256_hex.lower():
            return None
        try:
            key = bytes.fromhex(sha256_hex)
        except ValueError:
            return None
        if self._sha_order is None:
            self._sha_order = np.argsort(self.sha256.view("S32").ravel(), kind="stable")
        order, digests = self._sha_order, self.sha256
        lo, hi = 0, len(order)
        while lo < hi:  # a binary search through the order: log2(10^6) = 20 rows read, no sorted copy kept
            mid = (lo + hi) // 2
            if digests[order[mid]].tobytes() < key:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(order) and digests[order[lo]].tobytes() == key:
            return int(order[lo])
        return None
