"""How the blocks of a stream's epoch order lie over the dataset's shards when shards hold different record counts.

An epoch over a sharded dataset goes block by block (``StreamKey.block`` records of global indices,
``sharding.layout_block``). Where every shard holds one record count the blocks are the shards. Elsewhere (WebDataset
tars, Parquet files) a block is the mean shard size over global indices: it touches as many shards as its records
lie in (one huge shard among tiny ones is read in many blocks, a block of tiny shards touches many). This module
answers, from the manifest, what the producer needs of that mapping:

- ``BlockHoldings``: an elastic pool's trainer hands splits by the *blocks* a producer's cache holds
  (``Status.held``; consumer/exact/pool/shard_affinity.py), so the cached shards are said as the blocks whose
  records lie wholly in them.

Empty shards hold no record of any block and are never named.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from stoker.protocol.exact_messages import MAX_HELD

from stoker.producer.dataset.sources import RecordSource
from stoker.producer.dataset.sources.manifest import Manifest

__all__ = ["BlockHoldings", "BlockSpans"]


class BlockSpans:
    """Blocks of ``size`` records over ``layout``'s shards, from its non-empty shards as arrays (where each begins and
    ends in global indices, its bytes): O(shards) memory, built once."""

    def __init__(self, layout: Manifest, size: int) -> None:
        records = np.fromiter((s.records for s in layout.shards), np.int64, len(layout.shards))
        self.numbers = np.flatnonzero(records > 0)  # position among the non-empty shards -> shard number
        self.firsts = np.fromiter((s.first for s in layout.shards), np.int64, len(layout.shards))[self.numbers]
        self.ends = self.firsts + records[self.numbers]
        shard_bytes = np.fromiter((s.bytes for s in layout.shards), np.int64, len(layout.shards))
        self.cumulative_bytes = np.concatenate([[0], np.cumsum(shard_bytes[self.numbers])])
        self.mean_shard_bytes = float(shard_bytes.sum()) / max(1, len(layout.shards))
        self.size, self.count = size, layout.meta.count
        self.blocks = -(-self.count // size)
        self._capacity: Optional[tuple[int, int]] = None  # (capacity in shards, in blocks)

    def of_blocks(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)``: the positions (among non-empty shards) of the first and last shard each block touches."""
        starts = blocks * self.size
        lasts = np.minimum(starts + self.size, self.count) - 1
        return (np.searchsorted(self.firsts, starts, "right") - 1, np.searchsorted(self.firsts, lasts, "right") - 1)

    def capacity(self, shards: int) -> int:
        """A cache of ``shards`` shards' capacity in blocks: its budget (about ``shards`` mean shards' bytes) over the
        mean bytes of the shards a block touches (a block is held only with all of them), 1 at least."""
        if self._capacity is None or self._capacity[0] != shards:
            lo, hi = self.of_blocks(np.arange(self.blocks, dtype=np.int64))
            touched = float((self.cumulative_bytes[hi + 1] - self.cumulative_bytes[lo]).mean())
            self._capacity = (shards, max(1, int(shards * self.mean_shard_bytes // max(1.0, touched))))
        return self._capacity[1]

    def held_blocks(self, held: Sequence[int]) -> list[int]:
        """The blocks whose records lie wholly in the shards ``held`` (least recently used first; numbers outside
        the layout or of empty shards are passed over), least recently used first (a block's use: its least
        recently used shard's), at most ``MAX_HELD``. O(held log shards + the blocks the held shards touch)."""
        shards = np.asarray(held, np.int64)
        position = np.searchsorted(self.numbers, shards)
        known = position < len(self.numbers)
        known[known] = self.numbers[position[known]] == shards[known]
        position, rank = np.unique(position[known], return_index=True)  # sorted; rank: first place in LRU order
        rank = np.flatnonzero(known)[rank]
        if not len(position):
            return []
        # The blocks the held shards' records touch: only these may lie wholly in held shards.
        first, last = self.firsts[position] // self.size, (self.ends[position] - 1) // self.size
        lengths = last - first + 1
        offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        blocks = np.unique(np.repeat(first, lengths) + offsets)
        lo, hi = self.of_blocks(blocks)
        start, stop = np.searchsorted(position, lo), np.searchsorted(position, hi, "right")
        whole = stop - start == hi - lo + 1  # every shard from lo to hi is held (position is sorted, unique)
        blocks, start, stop = blocks[whole], start[whole], stop[whole]
        if not len(blocks):
            return []
        # Its least recently used shard's rank: a minimum over start:stop (pairs of reduceat bounds, a sentinel last).
        bounds = np.column_stack([start, stop]).ravel()
        used = np.minimum.reduceat(np.append(rank, len(held)), bounds)[::2]
        return blocks[np.lexsort((blocks, used))][-MAX_HELD:].tolist()


class BlockHoldings:
    """A pool producer's cache as its trainer reads it (``policies.pool.ShardCacheView``): blocks of ``size``
    records of the stream's layout. Over shards of one record count (or no layout, or every shard on local disk)
    it says the dataset's ``holdings()`` unchanged; over unequal ones, ``BlockSpans``' translation of them."""

    def __init__(self, dataset: RecordSource, size: int) -> None:
        self.dataset, self.size = dataset, size
        self._spans: Optional[BlockSpans] = None

    def holdings(self) -> tuple[Optional[int], list[int]]:
        capacity, held = self.dataset.holdings()
        layout = self.dataset.layout
        if capacity is None or layout is None or not self.size or layout.records_per_shard:
            return capacity, held
        if self._spans is None:
            self._spans = BlockSpans(layout, self.size)
        return self._spans.capacity(capacity), self._spans.held_blocks(held)
