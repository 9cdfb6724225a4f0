"""How an elastic pool's epochs are cut into splits and how many each producer holds: ``SchedulerPlan``.

A function of the trainer's configuration and the dataset alone: trainers sharing a pool must cut epochs alike
(their shares are splits), so nothing here depends on who is serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from stoker.protocol.exact_messages import MAX_SPLIT
from stoker.protocol.input_state import Progress, StreamKey

from stoker.consumer.exact.pool.split_scheduler import DEFAULT_AHEAD, SplitScheduler
from stoker.consumer.receive.options import STALL_AFTER_S

#: Batches of work a producer holds beyond its credit: what its workers make ahead of credit (one each,
#: ``PoolPolicy.make_ahead`` in producer/serve/policies/pool.py) with room to spare. With small splits, two
#: splits were two batches, too few to keep a producer's workers and credit busy: an elastic pool ran at 0.85 of
#: its old rate in benchmarks/exact_cost.py.
PIPELINE_BATCHES = 8
SPLIT_BATCHES = 16  # the largest split: this many batches of records
#: The fewest splits an epoch (of one trainer's share) is cut into, where batches allow: a pool of P producers
#: holding DEFAULT_AHEAD each needs 2P of them free, and a small dataset of few large splits left a joining
#: producer without any (issue 29: 1,024 records in splits of 16 batches made two splits an epoch).
MIN_SPLITS = 64


def splits_ahead(split: int, batch_size: int, credit: int) -> int:
    """Unfinished splits each producer holds: ``DEFAULT_AHEAD``, or enough to cover its credit and
    ``PIPELINE_BATCHES`` more batches if that is more (what is in flight between it and the trainer)."""
    batches_per_split = max(1, split // max(1, batch_size))
    return max(DEFAULT_AHEAD, -(-(credit + PIPELINE_BATCHES) // batches_per_split))


def split_records(records: int, batch_size: int, world: int = 1) -> int:
    """Records per split of a pool of ``records``: whole batches, at most ``SPLIT_BATCHES``, and few enough that an
    epoch of one of ``world`` shares has ``MIN_SPLITS`` splits where the dataset allows (a batch at least).

    A function of its arguments only: trainers sharing a pool must cut epochs alike (their shares are splits)."""
    batch_size = max(1, batch_size)
    batches = max(1, min(SPLIT_BATCHES, records // max(1, world * MIN_SPLITS) // batch_size))
    if batches * batch_size <= MAX_SPLIT:
        return batches * batch_size
    return (MAX_SPLIT // batch_size) * batch_size or MAX_SPLIT


@dataclass(frozen=True)
class SchedulerPlan:
    """Everything an elastic pool's scheduler is made from but the dataset, which the first pool producer's status
    names: ``scheduler(...)`` then cuts it (``split_records``) and sizes each producer's work (``splits_ahead``)."""

    batch_size: int  # splits are whole batches of the trainer's spec
    credit: int  # batches a producer may send ahead: what it holds covers them
    share: tuple[int, int] = (0, 1)  # (rank, world): this trainer's splits
    stall_after: Optional[float] = STALL_AFTER_S

    def scheduler(self, key: StreamKey, progress: Progress, complete: Callable[[int], None],
                  epochs: Optional[int]) -> SplitScheduler:
        """The scheduler of pool ``key`` (``epochs``: None for ever) reading ``progress``, reporting each epoch it
        completes to ``complete`` (``SplitScheduler``); ValueError if this trainer's share is empty."""
        split = split_records(key.records, self.batch_size, self.share[1])
        # A layout cuts splits at each window of shards too: they are no larger than a window.
        longest = min(split, key.block * key.window) if key.block else split
        return SplitScheduler(key, progress, complete, epochs, split, *self.share,
                              ahead=splits_ahead(longest, self.batch_size, self.credit), stall_after=self.stall_after)
