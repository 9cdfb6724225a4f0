"""Epoch order version 2: computed lazily, invertible, over shards of unequal sizes.

Order 1 (``input_state.epoch_order``) materialises a permutation of every record: 80 GB and a sort of 10^10
keys per epoch at web scale. Order 2 maps any epoch position to its record, and any record back to its
position, for just the positions at hand: a producer turns a split's positions into records, a trainer turns
a batch's records back into positions, and neither ever holds the epoch's whole order.

The order of epoch ``e`` (docs/protocol.md, "Epoch order 2", defines it bit for bit):

1. the shards are permuted, rank -> shard, by a keyed bijection on ``[0, S)``;
2. the shards' records are laid end to end in rank order ("concatenation space");
3. ranks ``[wW, (w+1)W)`` form window ``w``, a contiguous range of concatenation space; window ``w``
   occupies the same range of positions, and within it a keyed bijection of the window's records maps a
   position to its place in concatenation space.

So a split inside one window touches only that window's ``W`` shards. The keyed bijection is a Feistel
network with cycle walking (``keyed_bijection``). Per epoch only a plan of O(shards) is built and cached
(the permutation of the shards, its inverse, where each rank and window begins), never the per-record order.
"""

from __future__ import annotations

import hashlib
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from stoker.protocol.epochs.feistel import GOLDEN, ROUNDS, SHARDS_TAG, chain, keyed_bijection, mix, round_keys

__all__ = ["EpochPlan", "GOLDEN", "LazyOrder", "ROUNDS", "SHARDS_TAG", "ShardTable", "chain", "full_order",
           "keyed_bijection", "mix", "round_keys"]

MAX_SHARDS = 2**24
MAX_SHARD_RECORDS = 2**32 - 1
MAX_RECORDS = 2**40
MAX_EPOCH = 2**31 - 1
MEMO_BATCHES = 64  # batches whose positions are kept (a trainer's queue and credit window hold fewer)
MEMO_RECORDS = 8192  # the largest batch kept (64 of them: 4 MiB of keys and answers at most)
FULL_ORDER_LIMIT = 2**27  # full_order is for tests and small datasets: 1 GiB of int64 at most

def _as_indices(values: np.ndarray, limit: int, what: str) -> np.ndarray:
    """``values`` as int64, each in ``[0, limit)``; ValueError naming ``what`` otherwise."""
    values = np.asarray(values)
    if values.size and values.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {values.dtype}")
    if values.size and (values.min() < 0 or values.max() >= limit):
        raise ValueError(f"{what} must lie in [0, {limit}): got [{values.min()}, {values.max()}]")
    return values.astype(np.int64, copy=False)


def _checked_int(value: int, low: int, high: int, what: str) -> int:
    value = operator.index(value)
    if not low <= value <= high:
        raise ValueError(f"{what} must lie in [{low}, {high}], got {value}")
    return value


class ShardTable:
    """A dataset's shards in storage order and their record counts: shard ``j`` holds records
    ``offsets[j] .. offsets[j] + sizes[j] - 1``. Immutable, O(shards) memory.

    Limits (ValueError naming the one broken): 1 to 2**24 shards, each of 1 to 2**32 - 1 records, 1 to 2**40
    records in all.
    """

    __slots__ = ("_sizes", "_offsets", "_records")

    def __init__(self, sizes: np.ndarray) -> None:
        sizes = np.asarray(sizes)
        if sizes.ndim != 1 or not 1 <= sizes.size <= MAX_SHARDS:
            raise ValueError(f"a shard table holds 1 to {MAX_SHARDS} shards in one row, got shape {sizes.shape}")
        if sizes.dtype.kind not in "iu":
            raise ValueError(f"shard sizes must be integers, got dtype {sizes.dtype}")
        if sizes.min() < 1 or sizes.max() > MAX_SHARD_RECORDS:
            raise ValueError(f"each shard holds 1 to {MAX_SHARD_RECORDS} records, got sizes in "
                             f"[{sizes.min()}, {sizes.max()}]: drop empty shards, split huge ones")
        self._sizes = sizes.astype(np.int64)  # a copy: nobody else can change it
        records = int(self._sizes.sum())
        if records > MAX_RECORDS:
            raise ValueError(f"a dataset holds at most {MAX_RECORDS} (2**40) records, the table sums to {records}")
        self._offsets = np.zeros(sizes.size, np.int64)
        np.cumsum(self._sizes[:-1], out=self._offsets[1:])
        self._sizes.flags.writeable = self._offsets.flags.writeable = False
        self._records = records

    @classmethod
    def from_sizes(cls, sizes: np.ndarray | list[int]) -> "ShardTable":
        """The table of shards holding ``sizes[j]`` records each, in storage order."""
        return cls(np.asarray(sizes))

    @classmethod
    def uniform(cls, records: int, block: int) -> "ShardTable":
        """``records`` records in shards of ``block`` consecutive records (the last holds the rest)."""
        records = _checked_int(records, 1, MAX_RECORDS, "records")
        block = _checked_int(block, 1, MAX_SHARD_RECORDS, "block (records per shard)")
        shards = -(-records // block)
        if shards > MAX_SHARDS:
            raise ValueError(f"{records} records in blocks of {block} make {shards} shards, at most {MAX_SHARDS}: "
                             f"use blocks of at least {-(-records // MAX_SHARDS)} records")
        sizes = np.full(shards, block, np.int64)
        sizes[-1] = records - block * (shards - 1)
        return cls(sizes)

    @property
    def records(self) -> int:
        return self._records

    @property
    def shards(self) -> int:
        return int(self._sizes.size)

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[shards]``, read-only."""
        return self._sizes

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[shards]``, read-only: the first record of each shard (the exclusive cumsum of sizes)."""
        return self._offsets

    def shard_of(self, records: np.ndarray) -> np.ndarray:
        """int64: the shard holding each record; ValueError for a record outside ``[0, records)``."""
        records = _as_indices(records, self._records, "records")
        return np.searchsorted(self._offsets, records, side="right") - 1

    def digest(self) -> str:
        """16 hex digits: blake2b (8-byte digest) of the sizes as little-endian int64, for peers to compare."""
        return hashlib.blake2b(self._sizes.astype("<i8").tobytes(), digest_size=8).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardTable) and np.array_equal(self._sizes, other._sizes)

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        return f"ShardTable(shards={self.shards}, records={self.records}, digest={self.digest()})"


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's O(shards) plan: ``perm[rank]`` the shard at each rank, ``rank_of[shard]`` its inverse,
    ``cum[rank]`` where each rank begins in concatenation space (``cum[S]`` = records), ``bounds[w]`` where
    window ``w`` begins (``bounds[-1]`` = records), ``chain`` the key chain's value after (seed, epoch)."""

    perm: np.ndarray
    rank_of: np.ndarray
    cum: np.ndarray
    bounds: np.ndarray
    chain: int

    @property
    def nbytes(self) -> int:
        return self.perm.nbytes + self.rank_of.nbytes + self.cum.nbytes + self.bounds.nbytes


class LazyOrder:
    """Epoch order version 2 of a ``ShardTable`` with ``seed`` and windows of ``window`` shards (0: one window of
    all shards). Thread-safe; methods raise ValueError for an epoch outside ``[0, 2**31)`` or a position or
    record outside ``[0, table.records)``, and never allocate more than O(shards) plus O(values asked)."""

    VERSION = 2

    def __init__(self, table: ShardTable, seed: int, window: int, cached_epochs: int = 3) -> None:
        if not isinstance(table, ShardTable):
            raise ValueError(f"table must be a ShardTable, got {type(table).__name__}")
        self.table = table
        self.seed = operator.index(seed)
        self.window = _checked_int(window, 0, MAX_SHARDS, "window (shards per window; 0: all)")
        self._window_shards = table.shards if window == 0 else min(window, table.shards)
        self._cached_epochs = _checked_int(cached_epochs, 1, 64, "cached_epochs")
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple[int, bytes], np.ndarray] = OrderedDict()  # recent batches' positions

    def plan(self, epoch: int) -> EpochPlan:
        """Epoch ``epoch``'s plan, from the cache of the last ``cached_epochs`` used or built now (O(shards))."""
        epoch = _checked_int(epoch, 0, MAX_EPOCH, "epoch")
        with self._lock:
            if epoch in self._plans:
                self._plans.move_to_end(epoch)
                return self._plans[epoch]
        plan = self._build_plan(epoch)  # outside the lock: two threads may build it twice, both alike
        with self._lock:
            self._plans[epoch] = plan
            while len(self._plans) > self._cached_epochs:
                self._plans.popitem(last=False)
        return plan

    def _build_plan(self, epoch: int) -> EpochPlan:
        shards, table = self.table.shards, self.table
        ranks = np.arange(shards, dtype=np.uint64)  # int32 below: MAX_SHARDS < 2**31, half the bytes of int64
        perm = keyed_bijection(ranks, shards, round_keys(self.seed, epoch, SHARDS_TAG)[:, 0]).astype(np.int32)
        rank_of = np.empty(shards, np.int32)
        rank_of[perm] = ranks.astype(np.int32)
        cum = np.zeros(shards + 1, np.int64)
        np.cumsum(table.sizes[perm], out=cum[1:])
        bounds = np.append(cum[0:shards:self._window_shards], cum[-1])
        return EpochPlan(perm, rank_of, cum, bounds, int(chain(chain(0, self.seed % 2**64), epoch)[0]))

    def _window_keys(self, plan: EpochPlan, windows: np.ndarray) -> np.ndarray:
        base = chain(plan.chain, windows.astype(np.uint64))
        return np.stack([chain(base, i) for i in range(ROUNDS)])

    def _concatenated(self, plan: EpochPlan, positions: np.ndarray) -> np.ndarray:
        """Where each position's record lies in concatenation space."""
        window = np.searchsorted(plan.bounds, positions, side="right") - 1
        start = plan.bounds[window]
        return start + self._scrambled(plan, window, positions - start, inverse=False).astype(np.int64)

    def _scrambled(self, plan: EpochPlan, window: np.ndarray, local: np.ndarray, inverse: bool) -> np.ndarray:
        """Each offset ``local`` through its window's bijection (or its inverse). The round keys are made once per
        distinct window, not per value: a split, a batch, lies in one window (the common case costs one key set)."""
        if len(window) and (window == window[0]).all():
            w = int(window[0])
            return keyed_bijection(local, int(plan.bounds[w + 1] - plan.bounds[w]),
                                   self._window_keys(plan, window[:1])[:, 0], inverse=inverse)
        distinct, which = np.unique(window, return_inverse=True)
        keys = self._window_keys(plan, distinct)[:, which]
        return keyed_bijection(local, plan.bounds[window + 1] - plan.bounds[window], keys, inverse=inverse)

    def window_starts(self, epoch: int) -> np.ndarray:
        """int64 ``[windows]``: the position where each window begins (ascending, the first 0)."""
        return self.plan(epoch).bounds[:-1].copy()

    def window_of_shards(self, epoch: int, shards: np.ndarray) -> np.ndarray:
        """int64: the window each of ``shards`` falls in, in epoch ``epoch``."""
        shards = _as_indices(shards, self.table.shards, "shards").ravel()
        return self.plan(epoch).rank_of[shards].astype(np.int64) // self._window_shards

    def at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """int64: the record at each of ``positions`` (any shape flattened to one row) in epoch ``epoch``."""
        plan = self.plan(epoch)
        concatenated = self._concatenated(plan, _as_indices(positions, self.table.records, "positions").ravel())
        rank = np.searchsorted(plan.cum, concatenated, side="right") - 1
        return self.table.offsets[plan.perm[rank]] + concatenated - plan.cum[rank]

    def records(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """int64: the records at positions ``[start, stop)`` of epoch ``epoch``; allocates O(stop - start)."""
        start = _checked_int(start, 0, self.table.records, "start")
        stop = _checked_int(stop, start, self.table.records, "stop")
        return self.at(epoch, np.arange(start, stop, dtype=np.int64))

    def shard_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """int64: the shard of the record at each of ``positions`` in epoch ``epoch``."""
        plan = self.plan(epoch)
        concatenated = self._concatenated(plan, _as_indices(positions, self.table.records, "positions").ravel())
        return plan.perm[np.searchsorted(plan.cum, concatenated, side="right") - 1].astype(np.int64)

    def positions(self, epoch: int, records: np.ndarray) -> np.ndarray:
        """int64, read-only: the position of each of ``records`` in epoch ``epoch`` (the inverse of ``at``).

        A trainer asks this of one batch's records up to three times (as it arrives, and as a step consumes it: the
        state and the scheduler), so the answers for the last ``MEMO_BATCHES`` batches of at most ``MEMO_RECORDS``
        records are kept, looked up by the records' bytes."""
        records = _as_indices(records, self.table.records, "records").ravel()
        if len(records) > MEMO_RECORDS:
            found = self._positions(epoch, records)
            found.setflags(write=False)  # read-only whatever the size, as the remembered ones are
            return found
        key = (operator.index(epoch), records.tobytes())
        with self._lock:
            found = self._memo.get(key)
            if found is not None:
                self._memo.move_to_end(key)
                return found
        found = self._positions(epoch, records)
        found.setflags(write=False)  # shared by the callers that ask again
        with self._lock:
            self._memo[key] = found
            while len(self._memo) > MEMO_BATCHES:
                self._memo.popitem(last=False)
        return found

    def _positions(self, epoch: int, records: np.ndarray) -> np.ndarray:
        plan = self.plan(epoch)
        shard = self.table.shard_of(records)
        rank = plan.rank_of[shard].astype(np.int64)
        concatenated = plan.cum[rank] + records - self.table.offsets[shard]
        window = rank // self._window_shards
        start = plan.bounds[window]
        return start + self._scrambled(plan, window, concatenated - start, inverse=True).astype(np.int64)


def full_order(order: LazyOrder, epoch: int) -> np.ndarray:
    """Every record of epoch ``epoch`` in order: for tests and small datasets only (ValueError past 2**27)."""
    if order.table.records > FULL_ORDER_LIMIT:
        raise ValueError(f"full_order materialises every record: {order.table.records} is over {FULL_ORDER_LIMIT}; "
                         f"ask LazyOrder.records for the positions at hand")
    return order.records(epoch, 0, order.table.records)
