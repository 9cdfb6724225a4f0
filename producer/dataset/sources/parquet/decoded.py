"""Decoded Parquet row groups and the cache that keeps them (``parquet_shard.py``'s module doc says why).

A decoded group (``Group``) is, for each field, its Arrow values row by row, or a dictionary's values and each
row's code into them (a dictionary array's own scalars are ~25x slower to read than its two halves), plus each
row's bytes in its byte and text columns (``row_bytes``), summed once per group with NumPy so a reader can refuse
an oversized row before building a Python object of it.

``DecodedGroups`` keeps decoded groups, least recently used let go first, bounded by their Arrow buffers' bytes. It
belongs to one format object, made fresh for each dataset opened (``parquet_shard.make_format``), so its memory
is the dataset's and is freed with it; there is no process-wide cache.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DECODED_CACHE_BYTES = 1 << 30  # decoded row groups one dataset keeps, all its open Parquet shards together

#: one decoded column: (values, None) row by row, or (a dictionary's values, each row's code into them)
Column = tuple[pa.Array, Optional[pa.Array]]


class Group(NamedTuple):
    """One decoded row group: its columns by field, and each row's bytes in its byte and text columns."""

    columns: dict[str, Column]
    row_bytes: np.ndarray  # int64, one a row

    @property
    def nbytes(self) -> int:
        """Its Arrow buffers' and row sizes' bytes: what the cache counts."""
        arrays = sum(a.get_total_buffer_size() for pair in self.columns.values() for a in pair if a is not None)
        return arrays + self.row_bytes.nbytes


def split(array: pa.Array) -> Column:
    """``array`` as a ``Column``: a dictionary array as its two halves."""
    if pa.types.is_dictionary(array.type):
        return array.dictionary, array.indices
    return array, None


def _byte_typed(kind: pa.DataType) -> bool:
    return any(test(kind) for test in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_string,
                                       pa.types.is_large_string))


def decoded_group(columns: dict[str, Column], rows: int) -> Group:
    """``columns`` (``rows`` rows each) with each row's byte and text bytes summed: a null value, or a code that is
    null or outside its dictionary, counts 0 (the reader names it)."""
    row_bytes = np.zeros(rows, np.int64)
    for values, codes in columns.values():
        if not _byte_typed(values.type) or len(values) == 0:
            continue
        lengths = pc.fill_null(pc.binary_length(values), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        if codes is None:
            n = min(rows, len(lengths))
            row_bytes[:n] += lengths[:n]
            continue
        code = pc.fill_null(codes, -1).to_numpy(zero_copy_only=False).astype(np.int64)[:rows]
        inside = (code >= 0) & (code < len(lengths))
        row_bytes[:len(code)] += np.where(inside, lengths[np.where(inside, code, 0)], 0)
    return Group(columns, row_bytes)


class DecodedGroups:
    """Decoded row groups of every shard one format object opens, least recently used let go first, bounded by
    their decoded bytes: at most ``budget``, or one group alone where one is larger (decoded anyway: the shard
    warns). Entries are keyed by (owner, group), an owner one open shard (``new_owner``), so an entry is never
    served to another file; ``drop`` lets go of a closed shard's. One thread, like its shards."""

    def __init__(self, budget: int = DECODED_CACHE_BYTES) -> None:
        if budget < 0:
            raise ValueError(f"a decoded row group budget of {budget} bytes: give 0 or more")
        self.budget, self.nbytes, self.decodes = budget, 0, 0
        self._owners = itertools.count()
        self._groups: OrderedDict[tuple[int, int], tuple[Group, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def new_owner(self) -> int:
        return next(self._owners)

    def get(self, key: tuple[int, int]) -> Optional[Group]:
        entry = self._groups.get(key)
        if entry is None:
            return None
        self._groups.move_to_end(key)
        return entry[0]

    def make_room(self, nbytes: int) -> None:
        """Let go of the least recently used groups until ``nbytes`` more fit in the budget (or none is left)."""
        while self._groups and self.nbytes + nbytes > self.budget:
            self.nbytes -= self._groups.popitem(last=False)[1][1]

    def put(self, key: tuple[int, int], group: Group, nbytes: int) -> bool:
        """Keep ``group`` (``nbytes`` decoded) as the most recently used; False if it alone is over the budget."""
        old = self._groups.pop(key, None)
        self.nbytes -= old[1] if old else 0
        self.make_room(nbytes)
        self._groups[key] = (group, nbytes)
        self.nbytes += nbytes
        self.decodes += 1
        return nbytes <= self.budget

    def drop(self, owner: int) -> None:
        """Let go of every group of ``owner`` (a closed shard)."""
        for key in [k for k in self._groups if k[0] == owner]:
            self.nbytes -= self._groups.pop(key)[1]
