"""What an elastic pool's trainer knows of each producer serving it: one ``PoolMember`` record per producer.

``PoolMembers`` (the ``SplitScheduler``'s ``members``, by producer number) is the records' one owner: ``of``
makes a producer's record the first time it is handed work, measured or told of, ``drop`` forgets it when the
producer leaves or restarts (nothing of it applies any more). Each of the scheduler's parts writes its own part
of a record:

- the scheduler: ``splits`` (its unfinished splits in the order handed out; None until it is handed work),
  ``stuck`` (taken for stuck: no new work until it delivers again), ``hungry`` (known, not stuck, holding
  fewer than it should: a ``top_up`` could hand it something);
- ``PoolPace`` (``producer_pace``): ``pace``, how fast it makes progress (None: nothing measured yet);
- ``ShardHoldings`` (``shard_affinity``): ``cache``, the shards it is modelled to hold (None: every shard on its
  disk, or not told yet).

Not thread-safe: the scheduler's caller holds the control plane's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator, Optional

import numpy as np

Split = tuple[int, int]  # (epoch, split)


class ProducerPace:
    """How fast one producer makes progress (``producer_pace``)."""

    __slots__ = ("busy_since", "last_fresh", "seconds_per_record", "samples")

    def __init__(self, now: float) -> None:
        self.busy_since = now  # when it last went from holding no split to holding one
        self.last_fresh = now  # when a record of it last arrived first
        self.seconds_per_record: Optional[float] = None  # average while it held work (None: not measured yet)
        self.samples = 0  # batches the average is made of


class ShardCache:
    """The shards one producer is modelled to cache (``shard_affinity``): at most ``capacity``, least recently
    used first in ``lru``. O(capacity), never O(shards): a pool of 10^6 shards and 1,024 producers held a bool per
    shard for each producer (1 GB)."""

    __slots__ = ("capacity", "lru")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()


class ShardChoice:
    """The shards a pick by shard prefers (``take_pending``): ``numbers`` (sorted, unique), or every shard but them
    (``exclude``). O(numbers): a pick never builds anything per shard of the dataset."""

    __slots__ = ("numbers", "exclude")

    def __init__(self, numbers: Iterable[int], exclude: bool = False) -> None:
        self.numbers = np.unique(np.fromiter(numbers, np.int64))
        self.exclude = exclude

    def holds(self, shards: np.ndarray) -> np.ndarray:
        """bool per shard of ``shards``: whether it is one of the chosen."""
        shards = np.asarray(shards, np.int64)
        if not len(self.numbers):
            return np.full(shards.shape, self.exclude)
        at = np.minimum(np.searchsorted(self.numbers, shards), len(self.numbers) - 1)
        return (self.numbers[at] == shards) != self.exclude

    def mask(self, shards: int) -> np.ndarray:
        """bool per shard of a layout of ``shards``: for epoch order 1, whose epochs are O(records) anyway."""
        chosen = np.zeros(shards, bool)
        chosen[self.numbers[self.numbers < shards]] = True
        return ~chosen if self.exclude else chosen


class PoolMember:
    """See the module doc."""

    __slots__ = ("splits", "stuck", "hungry", "pace", "cache")

    def __init__(self) -> None:
        self.splits: Optional[dict[Split, None]] = None
        self.stuck = False
        self.hungry = False
        self.pace: Optional[ProducerPace] = None
        self.cache: Optional[ShardCache] = None


class PoolMembers(dict[int, PoolMember]):
    """The records by producer number, in the order producers were first handed work (see the module doc), and who
    holds which split both ways: each member's ``splits``, and ``holders`` (split -> the producers serving it; two
    when one backs the other up), kept together by ``hold``, ``unhold``, ``split_done`` and ``take_back``."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[Split, list[int]] = {}

    def of(self, producer: int) -> PoolMember:
        """``producer``'s record, made if it has none."""
        member = self.get(producer)
        if member is None:
            member = self[producer] = PoolMember()
        return member

    def assign(self, producer: int) -> dict[Split, None]:
        """``producer``'s unfinished splits, making it known to the scheduler (then it comes last in this order, as
        the producer handed work most recently for the first time)."""
        member = self.of(producer)
        if member.splits is None:
            member.splits = {}
            self[producer] = self.pop(producer)
        return member.splits

    def drop(self, producer: int) -> None:
        """``producer`` left the pool or restarted: nothing known of it applies any more (``take_back`` first)."""
        self.pop(producer, None)

    def splits_of(self, producer: int) -> dict[Split, None]:
        """``producer``'s unfinished splits (none if it is not known)."""
        member = self.get(producer)
        return member.splits or {} if member is not None else {}

    def holding(self, producer: int) -> int:
        """Unfinished splits ``producer`` holds (a split is dropped from its holders as its last record arrives)."""
        return len(self.splits_of(producer))

    def is_stuck(self, producer: int) -> bool:
        member = self.get(producer)
        return member is not None and member.stuck

    def stuck(self) -> frozenset[int]:
        """The producers taken for stuck."""
        return frozenset(p for p, m in self.items() if m.stuck)

    def hungry(self) -> list[int]:
        """The producers marked ``hungry``, those holding the fewest splits first (ties by number)."""
        return sorted((p for p, m in self.items() if m.hungry), key=self._fewest_first)

    def _fewest_first(self, producer: int) -> tuple[int, int]:
        return self.holding(producer), producer

    def hold(self, producer: int, split: Split) -> None:
        """``producer`` is handed ``split`` (``assign`` made it known)."""
        self.assign(producer)[split] = None
        self.holders.setdefault(split, []).append(producer)

    def unhold(self, producer: int, split: Split) -> None:
        """``producer`` no longer holds ``split``."""
        self.splits_of(producer).pop(split, None)
        holders = self.holders.get(split)
        if holders is not None and producer in holders:
            holders.remove(producer)
            if not holders:
                del self.holders[split]

    def split_done(self, split: Split) -> list[int]:
        """Nothing of ``split`` is left to arrive: no one holds it any more; those who did (they have room now)."""
        holders = self.holders.pop(split, [])
        for p in holders:
            self.splits_of(p).pop(split, None)
        return holders

    def take_back(self, producer: int) -> list[Split]:
        """``producer`` no longer serves its splits (it stays known only if ``assign`` is called again); them."""
        member = self.get(producer)
        splits = list(member.splits or ()) if member is not None else []
        for split in splits:
            self.unhold(producer, split)
        if member is not None:
            member.splits = None
        return splits

    def serving(self, idle: int) -> Iterator[tuple[int, Split]]:
        """``(holder, the split it serves)`` for every producer but ``idle`` that is not stuck and serves a split
        nobody backs up yet: its first (later ones are queued work, which a backup would only make twice)."""
        for producer, member in self.items():
            mine = member.splits
            if producer != idle and not member.stuck and mine:
                first = next(iter(mine))
                if len(self.holders.get(first, ())) == 1:
                    yield producer, first
