"""Which records a producer serves, and in which order each epoch.

A shard ``I/N`` is the records with ``index % N == I``: disjoint across the N
producers and together the whole dataset. Each epoch permutes the shard with a
generator seeded by ``(seed, epoch)``, so order is reproducible and differs per
epoch. Within a producer, worker ``w`` of ``W`` takes every W-th element of
that permutation, so workers split each epoch exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``index`` of ``count`` (``--shard I/N``)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count} is invalid: need 0 <= I < N")

    @classmethod
    def parse(cls, text: str) -> "ShardSpec":
        """Parse ``"I/N"``; ValueError with a usage hint otherwise."""
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard expects I/N such as 0/2, got {text!r}") from None
        return cls(index, count)

    def records(self, dataset_size: int) -> np.ndarray:
        return np.arange(self.index, dataset_size, self.count, dtype=np.int64)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def epoch_order(shard_records: np.ndarray, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The shard's records in epoch ``epoch``'s order."""
    if not shuffle:
        return shard_records
    return np.random.default_rng([seed, epoch]).permutation(shard_records)


def worker_stream(shard_records: np.ndarray, seed: int, worker: int, workers: int, shuffle: bool = True):
    """Yield ``(epoch, record_index)`` forever: worker ``worker``'s share of each epoch."""
    epoch = 0
    while True:
        order = epoch_order(shard_records, seed, epoch, shuffle)
        for index in order[worker::workers]:
            yield epoch, int(index)
        epoch += 1
