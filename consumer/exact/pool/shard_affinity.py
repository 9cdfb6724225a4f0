"""Which shards each producer of an elastic pool holds, as its trainer models it, and the split to hand it by that.

A pool over a sharded dataset (a stream key with a layout, ``splits:count:seed:BxW``) orders each epoch block by
block (``epoch_order``; a block is B records: a dataset shard where shards are equal, else B is their mean size and
a block may span several, ``producer/serve/block_layout``), so a split's records come from one block or two. "Shard"
below means such a block. A producer reading object storage caches at most ``capacity`` shards, least recently used out; its status says that capacity and the shards it holds when it
joins (``Status.cache``, ``Status.held``). The trainer cannot see the cache afterwards, so it models it: every split
it hands a producer uses that split's shard in the producer's model, as the producer's cache does.

``ShardHoldings.pick(producer, epochs)`` is the split a producer should take next: a returned or new split of a
shard it holds; else one of a shard nobody holds (a fetch nobody else could have saved); else None, and the
scheduler falls back to the epoch's next free split (a fetch, but the epoch must complete: work is never held back
for affinity). A producer with its whole dataset on disk (capacity None) takes shards nobody holds first, leaving
the cached shards to the producers that hold them. Exactness does not depend on any of this. What is modelled of a
producer is its record's ``cache`` (``pool_member``).
Not thread-safe: the scheduler's caller holds the control plane's lock.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from stoker.consumer.exact.pool.pool_member import PoolMembers, ShardCache, ShardChoice
from stoker.consumer.exact.pool.range_split_epoch import PoolEpoch


class ShardHoldings:
    """See the module doc. ``shards``: shards in the dataset's layout; ``members``: the pool's per-producer records,
    whose ``cache`` this models (the scheduler owns them)."""

    def __init__(self, shards: int, members: PoolMembers) -> None:
        self.shards = shards
        #: shard -> bounded producers modelled to hold it (held shards only: O(producers x capacity), not O(shards))
        self.holders: dict[int, int] = {}
        self._members = members
        self._bounded = 0  # producers whose cache is bounded

    @property
    def bounded(self) -> bool:
        """Whether any producer's cache is bounded (else every producer holds everything: nothing to prefer)."""
        return self._bounded > 0

    def _cache(self, producer: int) -> Optional[ShardCache]:
        member = self._members.get(producer)
        return member.cache if member is not None else None

    def note(self, producer: int, capacity: Optional[int], held: Sequence[int] = ()) -> None:
        """Producer ``producer`` joined, caching at most ``capacity`` shards (None: every shard on its disk) and
        holding ``held`` (least recently used first; numbers outside the layout are ignored)."""
        self.forget(producer)
        if capacity is None:
            return
        self._members.of(producer).cache = ShardCache(max(1, capacity))
        self._bounded += 1
        for shard in held:
            if 0 <= shard < self.shards:
                self.use(producer, shard)

    def use(self, producer: int, shard: int) -> None:
        """Producer ``producer`` was handed a split of ``shard``: its cache holds it now, the least recently used
        out beyond its capacity. Nothing for a producer with every shard on disk."""
        cache = self._cache(producer)
        if cache is None:
            return
        lru = cache.lru
        if shard in lru:
            lru.move_to_end(shard)
            return
        lru[shard] = None
        self.holders[shard] = self.holders.get(shard, 0) + 1
        while len(lru) > cache.capacity:
            old, _ = lru.popitem(last=False)
            self._unheld(old)

    def _unheld(self, shard: int) -> None:
        left = self.holders[shard] - 1
        if left:
            self.holders[shard] = left
        else:
            del self.holders[shard]

    def forget(self, producer: int) -> None:
        """Producer ``producer`` left (or restarted: it says what it holds when it joins again)."""
        cache = self._cache(producer)
        if cache is None:
            return
        for shard in cache.lru:
            self._unheld(shard)
        self._members[producer].cache = None
        self._bounded -= 1

    def pick(self, producer: int, epochs: Iterable[tuple[int, PoolEpoch]],
             free: Callable[[int, int], bool]) -> Optional[tuple[int, int]]:
        """The split ``(epoch, split)`` producer ``producer`` should take (module doc), or None. ``epochs``: the open
        ones, oldest first; ``free(e, s)``: whether split ``s`` of epoch ``e`` may be handed out."""
        epochs = list(epochs)
        cache = self._cache(producer)
        if cache is not None:
            held = ShardChoice(cache.lru)
            for e, epoch in epochs:
                for s in epoch.returned:
                    if epoch.shard_of_split(s) in cache.lru and free(e, s):
                        epoch.returned.remove(s)
                        return e, s
                s = epoch.take_pending(held, lambda s, e=e: free(e, s))
                if s is not None:
                    return e, s
        nobody = ShardChoice(self.holders, exclude=True)  # O(shards held), however many shards the dataset has
        for e, epoch in epochs:
            s = epoch.take_pending(nobody, lambda s, e=e: free(e, s))
            if s is not None:
                return e, s
        return None
