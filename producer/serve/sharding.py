"""Which records a producer serves, and in which order each epoch.

A shard ``I/N`` is the records with ``index % N == I``, or on a dataset stored in
shards (``layout_block``) its blocks ``j % N == I`` (a block: the dataset's shard where
shards hold one record count, else the mean shard size of global indices), whole:
either way disjoint across the N producers and together the whole dataset
(``StreamKey.stream_records``). Each epoch permutes the shard with a generator seeded
by ``(seed, epoch)`` (two-level over a layout: ``epoch_order``), so order is
reproducible and differs per epoch. Within a producer, worker ``w`` of ``W`` takes
every W-th element of that permutation, so workers split each epoch exactly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from stoker.producer.dataset.sources.manifest import Manifest
from stoker.producer.serve.block_layout import uneven_layout
from stoker.protocol.input_state import MAX_WINDOW, StreamKey, epoch_order

__all__ = ["EpochOrders", "RecordRng", "ShardLookahead", "ShardSpec", "epoch_order", "layout_block", "worker_stream"]

log = logging.getLogger("stoker.producer")


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` of ``count`` (``--shard I/N``), or ``auto``: an elastic pool's producer, serving the
    splits of the whole dataset its trainers hand it (producer/serve/policies/pool.py)."""

    index: int = 0
    count: int = 1
    auto: bool = False

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count} is invalid: need 0 <= I < N")

    @classmethod
    def parse(cls, text: str) -> "ShardSpec":
        """Parse ``"I/N"`` or ``"auto"``; ValueError with a usage hint otherwise."""
        if text == "auto":
            return cls(auto=True)
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard expects I/N such as 0/2, or auto, got {text!r}") from None
        return cls(index, count)

    def __str__(self) -> str:
        return "auto" if self.auto else f"{self.index}/{self.count}"


def layout_block(shard: ShardSpec, shuffle_window: int, manifest: Optional[Manifest]) -> int:
    """The block size (records) of the stream's layout (``StreamKey.block``), 0 for none: on a dataset of several
    shards, unless ``--shuffle-window 0``, a pool's epochs and a fixed shard's are two-level shuffles
    (``epoch_order``) of blocks, and a fixed shard ``I/N`` is whole blocks. Shards of one record count are the
    blocks; shards of different counts (WebDataset tars, Parquet files) give blocks of the mean shard size
    (rounded up) over global indices, said in an info line: a block touches every shard its records lie in (one
    or two of near-equal shards; many tiny ones, or a part of a huge one), and a layout so uneven that a bounded
    cache fetches shards more than once an epoch is warned of (``block_layout.uneven_layout``). Called once, at
    producer start. ValueError for a window outside 0-``MAX_WINDOW``, or for more fixed shards than the dataset
    has blocks (some would serve nothing)."""
    if not 0 <= shuffle_window <= MAX_WINDOW:
        raise ValueError(f"--shuffle-window must be 0-{MAX_WINDOW} shards, got {shuffle_window}")
    if shuffle_window < 1 or manifest is None or len(manifest.shards) < 2:
        return 0
    block = manifest.records_per_shard or manifest.mean_shard_records
    blocks = -(-manifest.meta.count // block)  # the shards, where they hold one record count
    if not shard.auto and shard.count > blocks:
        what = "shards" if manifest.records_per_shard else f"blocks of {block} records (its mean shard)"
        raise ValueError(f"--shard {shard}: the dataset has {blocks} {what} and a fixed shard is whole {what}, so "
                         f"{shard.count - blocks} of {shard.count} producers would serve nothing; run at "
                         "most as many producers as shards, --shard auto (an elastic pool shares splits), or "
                         "--shuffle-window 0 (fixed shards of every N-th record)")
    if not manifest.records_per_shard:
        log.info("the dataset's shards hold different numbers of records: epochs go block by block, blocks of %d "
                 "records (the mean shard) over record indices, each reading the shards its records lie in", block)
        uneven = uneven_layout(manifest, block)
        if uneven:
            log.warning("%s", uneven)
    return block


class EpochOrders:
    """``StreamKey.order`` of one stream, remembered for the last few epochs: a worker's record stream and its
    ``ShardLookahead`` (which looks one epoch ahead) ask for the same orders."""

    KEPT = 3

    def __init__(self, key: StreamKey) -> None:
        self.key = key
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    def __call__(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = self.key.order(epoch)
            while len(self._orders) > self.KEPT:
                self._orders.popitem(last=False)
        return self._orders[epoch]


def worker_stream(orders: EpochOrders, worker: int, workers: int) -> Iterator[tuple[int, int]]:
    """Yield ``(epoch, record_index)`` forever: worker ``worker``'s share of each epoch of ``orders``' stream."""
    epoch = 0
    while True:
        order = orders(epoch)
        for index in order[worker::workers]:
            yield epoch, int(index)
        epoch += 1


class RecordRng:
    """The random generator for one record: a function of (seed, epoch, record index) alone.

    A counter-based Philox generator whose key is the seed and whose counter starts at
    ``(0, 0, index, epoch)``: every record of every epoch gets its own stream, so a record's
    augmentation does not depend on which worker made it, in which batch, or how often it was
    sent. ``for_record`` resets one reused generator (about 3 us, against 15 us to build one):
    use the returned generator for that record only.
    """

    _SALT = 0x53544F4B4552  # "STOKER": the key's second word

    def __init__(self, seed: int) -> None:
        self._key = np.array([int(seed) % 2**64, self._SALT], np.uint64)
        self._bits = np.random.Philox(key=self._key)
        self._generator = np.random.Generator(self._bits)

    def for_record(self, epoch: int, index: int) -> np.random.Generator:
        self._bits.state = {"bit_generator": "Philox",
                            "state": {"counter": np.array([0, 0, index, epoch], np.uint64), "key": self._key},
                            "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return self._generator


class ShardLookahead:
    """The dataset shard that comes after another in a stream's epoch order, to fetch it ahead: a shard-by-shard
    epoch (a layout, ``StreamKey.block``) reaches each shard once, and a cold cache would stall on every one.
    For fixed shards and plain streams (their order is the key's); a pool producer serves what its trainers hand
    it, so ``active`` is False there. ``orders``: the stream's epoch orders (shared with its ``worker_stream``)."""

    def __init__(self, orders: EpochOrders) -> None:
        key = self.key = orders.key
        self.orders = orders
        self.active = bool(key.block) and not key.splits
        self._next: OrderedDict[int, tuple[dict[int, int], int]] = OrderedDict()  # epoch -> (next of each, first)
        self._at: Optional[tuple[int, int]] = None

    def _sequence(self, epoch: int) -> tuple[dict[int, int], int]:
        if epoch not in self._next:
            shards = self.orders(epoch) // self.key.block
            _, first = np.unique(shards, return_index=True)
            sequence = shards[np.sort(first)].tolist()  # the shards in the order the epoch reaches them
            self._next[epoch] = (dict(zip(sequence[:-1], sequence[1:])), sequence[0])
            while len(self._next) > 2:
                self._next.popitem(last=False)
        return self._next[epoch]

    def after(self, epoch: int, index: int) -> Optional[int]:
        """When reading record ``index`` of ``epoch`` begins another shard: the shard after it (the next epoch's
        first after the last); else None."""
        if not self.active:
            return None
        shard = index // self.key.block
        if self._at == (epoch, shard):
            return None
        self._at = (epoch, shard)
        following, _ = self._sequence(epoch)
        return following[shard] if shard in following else self._sequence(epoch + 1)[1]
