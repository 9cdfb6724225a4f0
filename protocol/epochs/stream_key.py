"""Stream keys: what one producer serves, named in every batch, message and state of exact mode.

A *stream* is shard ``I/N`` of a dataset of ``count`` records, shuffled with ``seed``: key ``"I/N:count:seed"``;
the shard's records are ``I, I+N, I+2N, ...``, numbered ``k = 0, 1, 2, ...`` within the shard. An elastic pool's
key is ``"splits:count:seed"``. Either ends in ``":BxW"`` for a dataset stored in shards of ``B`` records: a fixed
shard ``I/N`` is then the dataset's shards ``j % N == I``, whole, and epochs are two-level shuffles. A key ending in
``":o2"`` is in *epoch order 2* (``epoch_order.LazyOrder``: computed for just the positions at hand, any size up to
``MAX_RECORDS``; a fixed shard's order 2 orders its own records ``k``); without it, in *epoch order 1*
(``epoch_order`` below: a whole permutation, at most ``MAX_MATERIALISED_RECORDS`` records). docs/protocol.md
defines both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from stoker.protocol.epochs.epoch_order import MAX_SHARD_RECORDS, MAX_SHARDS, LazyOrder, ShardTable

_KEY_RE = re.compile(r"^(\d+)/(\d+):(\d+):(-?\d+)(?::(\d+)x(\d+))?(?::o(\d+))?$")
_SPLITS_RE = re.compile(r"^splits:(\d+):(-?\d+)(?::(\d+)x(\d+))?(?::o(\d+))?$")
MAX_WINDOW = 1 << 16  # shards in one shuffle window
ORDER_VERSIONS = (1, 2)  #: epoch orders this Stoker computes
#: Dataset sizes reach this and record indices stay below it, in every key, message and state (issue 41): naming
#: a record costs nothing; what a message or state expands to is bounded apart, before allocating.
MAX_RECORDS = 2**40
#: Records of a dataset whose epochs are ordered or tracked one entry per record (epoch order 1's permutation,
#: open epochs' bitmaps): ``check_materialisable``, the one check, runs before such arrays are built.
MAX_MATERIALISED_RECORDS = 10**8


class TooManyRecordsError(ValueError):
    """A dataset too large for one entry per record (epoch order 1); the text names the limit and the way out."""


def check_materialisable(records: int, what: str) -> None:
    """TooManyRecordsError naming ``what`` unless ``records`` fit one entry each (``MAX_MATERIALISED_RECORDS``)."""
    if records > MAX_MATERIALISED_RECORDS:
        raise TooManyRecordsError(f"{what} holds {records:,} records: epoch order 1 keeps one entry per record and "
                                  f"serves at most {MAX_MATERIALISED_RECORDS:,} (10**8) records; order 2 (lazy) is "
                                  "needed beyond")


def epoch_order(shard_records: np.ndarray, seed: int, epoch: int, shuffle: bool = True, block: int = 0,
                window: int = 1) -> np.ndarray:
    """The shard's records in epoch ``epoch``'s order: a permutation seeded by ``(seed, epoch)``.

    ``block`` > 0: a two-level shuffle of a dataset stored in blocks (its shards) of ``block`` consecutive
    records (the last may hold fewer): the blocks are permuted, then the records within each *window* of
    ``window`` consecutive blocks of that permutation, so consecutive positions come from few shards. With
    ``block`` 0 the whole shard is one permutation.

    Part of the protocol: an elastic pool's work messages name positions in this order, so
    producers and trainers must compute it alike (NumPy's PCG64: ``permutation`` for the flat order; for the
    two-level one, ``permutation`` of the blocks then ``integers(0, 2**32, n)`` as the sort keys within windows,
    ties broken by position).
    """
    if not shuffle:
        return shard_records
    rng = np.random.default_rng([seed, epoch])
    if block <= 0:
        return rng.permutation(shard_records)
    records = len(shard_records)
    blocks = -(-records // block)
    rank = np.empty(blocks, np.int64)
    rank[rng.permutation(blocks)] = np.arange(blocks, dtype=np.int64)
    window_of = rank[np.arange(records, dtype=np.int64) // block] // max(1, window)
    keys = (window_of << 32) | rng.integers(0, 2**32, records, dtype=np.int64)
    return shard_records[np.argsort(keys, kind="stable")]


def rows_by_epoch(epochs: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``[(epoch, rows of it)]`` of a batch's epoch column, epochs ascending. A batch nearly always holds one
    epoch: that case costs one comparison, not a sort."""
    epochs = np.asarray(epochs)
    if not epochs.size:
        return []
    first = epochs[0]
    if (epochs == first).all():
        return [(int(first), np.arange(epochs.size))]
    return [(int(e), np.flatnonzero(epochs == e)) for e in np.unique(epochs)]


@dataclass(frozen=True)
class StreamKey:
    """Shard ``index/count`` of a dataset of ``records`` records, shuffled with ``seed``.

    ``splits``: the whole dataset shared by an elastic pool (``--shard auto``): each trainer hands
    out splits of every epoch to whichever producers are there (``"splits:count:seed"``). ``block``: the
    dataset is stored in shards of this many records (0: not known, one LMDB); then a fixed shard ``I/N`` is the
    dataset's shards ``j`` with ``j % N == I``, whole, and every epoch is a two-level shuffle with windows of
    ``window`` shards (``epoch_order``; the key ends in ``":BxW"``).
    """

    index: int
    count: int
    records: int
    seed: int
    splits: bool = False
    block: int = 0
    window: int = 1
    order_version: int = 1  #: 1: ``epoch_order``, materialised; 2: ``LazyOrder`` (the key ends in ``:o2``)

    def __post_init__(self) -> None:
        if self.order_version == 2 and self.size:  # what LazyOrder's table can hold, checked once, here
            shard = self.block or self.size
            if shard > MAX_SHARD_RECORDS or -(-self.size // shard) > MAX_SHARDS:
                raise ValueError(
                    f"stream {self}: epoch order 2 orders shards of at most {MAX_SHARD_RECORDS:,} records, at most "
                    f"{MAX_SHARDS:,} of them; " + ("an unsharded dataset is one shard: store it sharded "
                                                  "(stoker lmdb build --shard-size)" if not self.block else
                                                  "use larger shards"))

    @classmethod
    def parse(cls, text: str) -> "StreamKey":
        match = _SPLITS_RE.match(text)
        fixed = None if match else _KEY_RE.match(text)
        if not match and not fixed:
            raise ValueError(f"stream key {text!r} is not I/N:count:seed or splits:count:seed (either with :BxW, "
                             "and :o2 for epoch order 2)")
        groups = (match or fixed).groups()  # type: ignore[union-attr]
        order = int(groups[-1]) if groups[-1] is not None else 1
        if order not in ORDER_VERSIONS:
            raise ValueError(f"stream key {text!r} names epoch order {order}; this Stoker computes orders "
                             f"{ORDER_VERSIONS}: upgrade the trainer to match the producers")
        groups = groups[:-1]
        block, window = (int(groups[-2]), int(groups[-1])) if groups[-2] is not None else (0, 1)
        if groups[-2] is not None and not (1 <= block <= MAX_RECORDS and 1 <= window <= MAX_WINDOW):
            raise ValueError(f"stream key {text!r} names an invalid shard layout (BxW: B >= 1 records per "
                             f"shard, W 1-{MAX_WINDOW} shards per window)")
        if match:
            records, seed = int(groups[0]), int(groups[1])
            if not 0 <= records <= MAX_RECORDS:
                raise ValueError(f"stream key {text!r} names an invalid dataset size (0 to 2**40 records)")
            return cls(0, 1, records, seed, splits=True, block=block, window=window, order_version=order)
        index, count, records, seed = (int(g) for g in groups[:4])
        if count < 1 or not 0 <= index < count or not 0 <= records <= MAX_RECORDS:
            raise ValueError(f"stream key {text!r} names an invalid shard (I/N with 0 <= I < N, 0 to 2**40 records)")
        return cls(index, count, records, seed, block=block, window=window, order_version=order)

    @staticmethod
    def names_pool(text: str) -> bool:
        """Whether stream key ``text`` names an elastic pool (``parse(text).splits``), without parsing it: a
        trainer asks this of every batch's stream. False for "" (not known yet) and for a fixed shard's key."""
        return text.startswith("splits:")

    def __str__(self) -> str:
        layout = (f":{self.block}x{self.window}" if self.block else "") + (":o2" if self.order_version == 2 else "")
        if self.splits:
            return f"splits:{self.records}:{self.seed}{layout}"
        return f"{self.index}/{self.count}:{self.records}:{self.seed}{layout}"

    @property
    def shards(self) -> int:
        """Shards of the dataset's layout (``block``); 0 when the layout is not known."""
        return -(-self.records // self.block) if self.block else 0

    def _strided(self) -> bool:
        return not self.splits and self.count > 1

    def lazy_order(self) -> LazyOrder:
        """Epoch order 2 of this stream over its own records ``k`` (the same object for equal keys: its per-epoch
        plans are cached). A pool's ``k`` are the dataset's records; a fixed shard's are its dataset shards
        ``j % N == I`` in ascending ``j`` laid end to end (``local``/``records_of``), so its table is ``size``
        records in blocks of ``block`` (only its last shard, the dataset's last, may be short); an unlaid fixed
        shard is one block. ValueError in epoch order 1, or for a stream of no records."""
        if self.order_version != 2:
            raise ValueError(f"stream {self} is in epoch order 1: it has no lazy order")
        return _lazy_order(self.size, self.block, self.window, self.seed)

    def positions(self, epoch: int, indices: np.ndarray) -> np.ndarray:
        """Epoch order 2: the epoch positions of dataset records ``indices`` in this stream (ValueError for records
        of other streams): what a trainer's state keeps (``RangeProgress``)."""
        indices = np.asarray(indices, np.int64)
        return self.lazy_order().positions(epoch, self.local(indices) if self._strided() else indices)

    def records_at(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Epoch order 2: the dataset records at positions ``[start, stop)`` of epoch ``epoch``; O(stop - start)."""
        return self.records_of(self.lazy_order().records(epoch, start, stop))

    def check_materialisable(self) -> None:
        """TooManyRecordsError unless this stream's dataset fits epoch order 1 (one entry per record)."""
        check_materialisable(self.records, f"the dataset of stream {self}")

    def stream_records(self) -> np.ndarray:
        """int64 [size]: the dataset's records this stream serves, ascending (position ``k`` -> record).
        TooManyRecordsError, before allocating, beyond ``MAX_MATERIALISED_RECORDS`` (``order`` too): the dataset's
        records in epoch order 1, the stream's in order 2; ValueError for a pool in order 2 (never materialised)."""
        self.check_whole_order()
        return self.records_of(np.arange(self.size, dtype=np.int64))

    def check_whole_order(self) -> None:
        """Raise unless this stream's epoch order may be materialised, one entry per record (``order``, a fixed
        shard's per-record bookkeeping): TooManyRecordsError beyond ``MAX_MATERIALISED_RECORDS`` (the dataset's
        records in order 1, the stream's own in order 2); ValueError for a pool in order 2."""
        if self.order_version == 1:
            self.check_materialisable()
        elif self.splits:
            raise ValueError(f"stream {self} is an elastic pool in epoch order 2: use lazy_order(), never a whole "
                             "order")
        else:  # a fixed shard's producer keeps per-record arrays over its own stream, never the dataset's
            check_materialisable(self.size, f"fixed shard {self}")

    def order(self, epoch: int) -> np.ndarray:
        """The stream's records in epoch ``epoch``'s order (``epoch_order``; a pool's: the whole dataset's). In
        epoch order 2, a fixed shard's ``lazy_order`` materialised: O(size), TooManyRecordsError beyond
        ``MAX_MATERIALISED_RECORDS`` records of the stream; a pool's is refused (ValueError)."""
        if self.order_version == 2:
            self.check_whole_order()
            return self.records_at(epoch, 0, self.size)
        return epoch_order(self.stream_records(), self.seed, epoch, block=self.block, window=self.window)

    def records_of(self, local: np.ndarray) -> np.ndarray:
        """Positions ``k`` within the stream -> dataset record indices (the inverse of ``local``); ``k`` are not
        checked against ``size``."""
        local = np.asarray(local, np.int64)
        if not self._strided():
            return local.copy()
        if self.block:
            return (local // self.block * self.count + self.index) * self.block + local % self.block
        return local * self.count + self.index

    @property
    def size(self) -> int:
        """Records in the shard."""
        if not self._strided() or not self.block:
            return len(range(self.index, self.records, self.count))
        blocks = len(range(self.index, self.shards, self.count))
        short = self.shards * self.block - self.records  # what the dataset's last shard lacks
        return blocks * self.block - (short if (self.shards - 1) % self.count == self.index and blocks else 0)

    def owns(self, indices: np.ndarray) -> np.ndarray:
        """bool per record index: whether this stream serves it."""
        indices = np.asarray(indices, np.int64)
        ok = (indices >= 0) & (indices < self.records)
        if not self._strided():
            return ok
        if self.block:
            return ok & ((indices // self.block) % self.count == self.index)
        return ok & ((indices - self.index) % self.count == 0)

    def local(self, indices: np.ndarray) -> np.ndarray:
        """Record indices -> positions ``k`` within the shard; ValueError for records of other shards."""
        indices = np.asarray(indices, np.int64)
        if not indices.size:
            return indices
        if not self.owns(indices).all():
            raise ValueError(f"record indices outside shard {self}")
        if not self._strided():
            return indices.copy()  # the whole dataset (one shard, an elastic pool): positions are the indices
        if self.block:
            return (indices // self.block) // self.count * self.block + indices % self.block
        return (indices - self.index) // self.count


@lru_cache(maxsize=256)
def _lazy_order(records: int, block: int, window: int, seed: int) -> LazyOrder:
    """One ``LazyOrder`` per stream (its plans are what is worth sharing between the scheduler and the state). 256: a
    trainer reading many fixed shards marks each batch's; their plans together are O(the dataset's shards)."""
    table = ShardTable.uniform(records, block or records)
    return LazyOrder(table, seed, window if block else 1)
