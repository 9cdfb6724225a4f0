"""How the blocks of a stream's epoch order lie over the dataset's shards when shards hold different record counts.

An epoch over a sharded dataset goes block by block (``StreamKey.block`` records of global indices,
``sharding.layout_block``). Where every shard holds one record count the blocks are the shards. Elsewhere (WebDataset
tars, Parquet files) a block is the mean shard size over global indices: it touches as many shards as its records
lie in (one huge shard among tiny ones is read in many blocks, a block of tiny shards touches many). This module
answers, from the manifest, what the producer needs of that mapping:

- ``block_shards``, ``fetch_block_ahead``: the shards a block touches, what a worker fetches ahead before the
  block's first read;
- ``BlockHoldings``: an elastic pool's trainer hands splits by the *blocks* a producer's cache holds
  (``Status.held``; consumer/exact/pool/shard_affinity.py), so the cached shards are said as the blocks whose
  records lie wholly in them;
- ``uneven_layout``: the warning for a layout so uneven that a bounded cache fetches shards more than once an epoch.

Empty shards hold no record of any block and are never named.
"""

from __future__ import annotations

from itertools import islice
from typing import Optional, Sequence

import numpy as np

from stoker.protocol.exact_messages import MAX_HELD

from stoker.producer.dataset.sources import RecordSource
from stoker.producer.dataset.sources.manifest import Manifest
from stoker.producer.dataset.sources.shard_cache import PREFETCH_AHEAD_SHARDS

__all__ = ["BlockHoldings", "BlockSpans", "UNEVEN_SHARDS", "block_shards", "fetch_block_ahead", "uneven_layout"]

UNEVEN_SHARDS = 4  # a shard over this many times the mean, or a block touching more shards: warned of at start


def block_shards(layout: Manifest, size: int, block: int, limit: int) -> list[int]:
    """The first ``limit`` shards (numbers in ``layout``) holding records of block ``block`` (records ``block *
    size`` on, ``size`` of them, the last block fewer), in index order; [] for a block past the dataset. Walks the
    shards the block touches only, stopping at ``limit``."""
    first = block * size
    if not 0 <= first < layout.meta.count:
        return []
    last = min(first + size, layout.meta.count) - 1
    touched = range(layout.shard_of(first), layout.shard_of(last) + 1)
    return list(islice((n for n in touched if layout.shards.records[n]), max(0, limit)))


def fetch_block_ahead(dataset: RecordSource, size: int, block: int) -> list[int]:
    """Ask ``dataset`` to fetch ahead the shards of block ``block`` of ``size`` records (a worker does as it begins
    the block before): every shard the block touches, up to ``PREFETCH_AHEAD_SHARDS`` (the rest are fetched by
    their reads); the cache drops what its budget has no room for (``ShardCache.prefetch``). Returns the shards
    asked for; a no-op where every shard is local or there is no layout."""
    layout = dataset.layout
    if layout is None or not size:
        return []
    shards = block_shards(layout, size, block, PREFETCH_AHEAD_SHARDS)
    for shard in shards:
        dataset.prefetch(shard)
    return shards


class BlockSpans:
    """Blocks of ``size`` records over ``layout``'s shards, from its non-empty shards as arrays (where each begins and
    ends in global indices, its bytes): O(shards) memory, built once."""

    def __init__(self, layout: Manifest, size: int) -> None:
        records = layout.shards.records  # the table's columns: no ShardInfo made per shard
        self.numbers = np.flatnonzero(records > 0)  # position among the non-empty shards -> shard number
        self.firsts = layout.shards.first[self.numbers]
        self.ends = self.firsts + records[self.numbers]
        shard_bytes = layout.shards.bytes
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


def uneven_layout(layout: Manifest, size: int) -> Optional[str]:
    """What to warn of (or None) for blocks of ``size`` records over ``layout``: a shard over ``UNEVEN_SHARDS`` times
    the mean, or a block touching more than ``UNEVEN_SHARDS`` shards. O(shards + blocks), once at start."""
    spans = BlockSpans(layout, size)
    largest = int((spans.ends - spans.firsts).max(initial=0))
    lo, hi = spans.of_blocks(np.arange(spans.blocks, dtype=np.int64))
    widest = int((hi - lo).max(initial=-1)) + 1
    if largest <= UNEVEN_SHARDS * size and widest <= UNEVEN_SHARDS:
        return None
    return (f"the dataset's shards are very uneven for blocks of {size} records (the mean shard): the largest holds "
            f"{largest} records ({largest / size:.1f}x the mean) and a block touches up to {widest} shards. A shard "
            "is read in every block its records fall in, at that block's time in the epoch, so a bounded cache "
            "(--cache-size below the dataset) fetches such shards more than once an epoch. Fix: reshard to about "
            "equal record counts (tars or Parquet files of one size); --shuffle-window 0 drops the blocks for one "
            "shuffle of the whole dataset, which suits only a cache that holds every shard")


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
