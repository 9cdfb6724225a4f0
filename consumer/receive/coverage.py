"""Which records of each epoch an input received: ``Coverage``, per shard, where epochs are counted.

Epochs are numbered by whoever orders the records. A plain (or fixed-shard exact) producer serving shard
``I/N`` counts the epochs of its own shard, so two producers on shards 0/2 and 1/2 drift apart (a
faster one, or a smaller shard, is epochs ahead): epoch 262 of shard 0/2 and epoch 262 of shard 1/2 are
unrelated, and counting them together shows every epoch half-covered while nothing is missing. So
coverage is kept per shard: ``("0/2", epoch) -> (distinct records received, records in shard 0/2)``.
An elastic pool (``splits:records:seed``) numbers epochs for the whole dataset (the trainers hand out
splits of each), as does a single producer on shard 0/1: one coverage, labelled ``"all"``.

It counts what the input *received* (its queue's pre-fill and batches not yet trained on included),
from each batch's ``index``/``epoch`` rows and the stream its header names. Memory is bounded: a bitmap
(one byte per record) for each of the last ``COVERAGE_EPOCHS`` epochs of each shard, at most
``MAX_COVERAGE_SHARDS`` shards whose sizes add up to at most ``MAX_COVERAGE_RECORDS`` (4 x 256 MiB at most,
4 bytes per record of a dataset whose shards are all tracked). Batches of a shard past those bounds are not
counted (``untracked_batches``, ``InputStats.coverage_untracked_batches``, and the training summary say how
many), nor are batches of streams that name another dataset size than the first (two datasets in one job
have no single coverage). Replicas of one shard (the same shard, another seed) share that shard's bitmaps:
their epochs count together.
No TensorFlow here: the framework-free ``BatchStream`` uses it too.
"""

from __future__ import annotations

from typing import Mapping, Union

import numpy as np

from stoker.protocol.input_state import StreamKey

WHOLE_DATASET = "all"  #: the shard label of a stream that serves the whole dataset (an elastic pool, shard 0/1)
COVERAGE_EPOCHS = 4  #: recent epochs kept per shard
MAX_COVERAGE_SHARDS = 64  #: shards tracked at most; further shards' batches are not counted
MAX_PARSED_STREAMS = 4096  #: stream keys kept parsed (one per producer's stream; more: parsed again)
MAX_COVERAGE_RECORDS = 1 << 28  # records of all tracked shards: one byte each per epoch, 256 MiB per epoch at most

#: (shard label, epoch) -> (distinct records received, records in that shard)
CoverageMap = Mapping[tuple[str, int], tuple[int, int]]


def shard_label(key: StreamKey) -> str:
    """``"I/N"`` for a fixed shard, ``"all"`` where the stream's epochs cover the whole dataset."""
    return WHOLE_DATASET if key.splits or key.count == 1 else f"{key.index}/{key.count}"


class _ShardEpochs:
    """One shard's bitmaps: which of its ``size`` records arrived in each of its last few epochs."""

    def __init__(self, size: int, epochs: int) -> None:
        self.size, self.epochs = size, epochs
        self.seen: dict[int, np.ndarray] = {}
        self.count: dict[int, int] = {}

    def add(self, epochs: np.ndarray, positions: np.ndarray) -> None:
        if not len(epochs):
            return
        first = int(epochs[0])
        one_epoch = bool((epochs == first).all())  # the common case: a batch within one epoch, one search less
        for e in [first] if one_epoch else np.unique(epochs).tolist():
            if e not in self.seen:
                if len(self.seen) >= self.epochs and e < min(self.seen):
                    continue  # older than anything kept
                self.seen[e], self.count[e] = np.zeros(self.size, bool), 0
                while len(self.seen) > self.epochs:
                    oldest = min(self.seen)
                    del self.seen[oldest], self.count[oldest]
            bitmap = self.seen[e]
            fresh = np.unique(positions if one_epoch else positions[epochs == e])
            self.count[e] += int((~bitmap[fresh]).sum())
            bitmap[fresh] = True


class Coverage:
    """Distinct records received per shard and recent epoch; see the module doc. Not thread-safe: the caller
    locks. ``epochs``, ``max_shards``, ``max_records``: the bounds (defaults: the module's constants)."""

    def __init__(self, epochs: int = COVERAGE_EPOCHS, max_shards: int = MAX_COVERAGE_SHARDS,
                 max_records: int = MAX_COVERAGE_RECORDS) -> None:
        self.epochs, self.max_shards, self.max_records = epochs, max_shards, max_records
        self.records = 0  #: the dataset's size, from the first stream counted
        self.untracked_batches = 0  #: batches of shards past the bounds, not counted
        self._shards: dict[str, _ShardEpochs] = {}
        self._layouts: dict[str, int] = {}  # label -> the layout (``StreamKey.block``) its bitmaps are positions of
        self._keys: dict[str, StreamKey | None] = {}  # stream -> its key, parsed once (None: not a stream key)

    def add(self, stream: str, epochs: np.ndarray, indices: np.ndarray,
            rows: Union[np.ndarray, slice] = slice(None)) -> None:
        """Count a batch's rows (``rows``: a mask or slice of the real ones) of the stream ``stream`` names."""
        key = self._keys.get(stream, False) if stream else None
        if key is False:
            try:
                key = StreamKey.parse(stream)
            except ValueError:
                key = None
            if len(self._keys) >= MAX_PARSED_STREAMS:
                self._keys.clear()  # bounded: streams of a pool that came and went
            self._keys[stream] = key
        if key is None or not key.records or self.records not in (0, key.records):
            return
        shard = self._shard(key)
        if shard is None:
            self.untracked_batches += 1
            return
        self.records = key.records
        epochs, indices = np.asarray(epochs)[rows].astype(np.int64), np.asarray(indices)[rows].astype(np.int64)
        ok = key.owns(indices) & (epochs >= 0)  # rows of another shard: not this shard's to count
        shard.add(epochs[ok], key.local(indices[ok]))

    def _shard(self, key: StreamKey) -> "_ShardEpochs | None":
        label = shard_label(key)
        shard = self._shards.get(label)
        if shard is not None and (shard.size, self._layouts.get(label)) != (key.size, key.block):
            return None  # the same shard number over another layout (a misconfigured job, named elsewhere)
        if shard is None:
            tracked = sum(s.size for s in self._shards.values())
            if len(self._shards) >= self.max_shards or tracked + key.size > self.max_records:
                return None
            shard = self._shards[label] = _ShardEpochs(key.size, self.epochs)
            self._layouts[label] = key.block
        return shard

    def snapshot(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``(shard label, epoch) -> (distinct records received, records in the shard)``, sorted."""
        return {(label, e): (n, shard.size) for label, shard in sorted(self._shards.items(), key=lambda i: _order(i[0]))
                for e, n in sorted(shard.count.items())}


def _order(label: str) -> tuple[int, int]:
    """Shards in their natural order (2/16 before 10/16), the whole dataset first."""
    if label == WHOLE_DATASET:
        return (0, 0)
    index, _, count = label.partition("/")
    return (int(count), int(index))


def coverage_lines(coverage: CoverageMap) -> list[str]:
    """One line per shard: ``shard 0/2, epoch 262: 32/32 (100%), epoch 263: 5/32 (16%)``; a single
    whole-dataset coverage reads as before, ``epoch 3: 1,200/1,200 (100%), ...``."""
    by_shard: dict[str, list[str]] = {}
    for (label, e), (seen, records) in sorted(coverage.items(), key=lambda item: (_order(item[0][0]), item[0][1])):
        if records:
            by_shard.setdefault(label, []).append(f"epoch {e}: {seen:,}/{records:,} ({100 * seen / records:.0f}%)")
    if list(by_shard) == [WHOLE_DATASET]:
        return [", ".join(by_shard[WHOLE_DATASET])]
    return [("whole dataset, " if label == WHOLE_DATASET else f"shard {label}, ") + ", ".join(epochs)
            for label, epochs in by_shard.items()]


def coverage_text(coverage: CoverageMap) -> str:
    """``coverage_lines`` on one line, shards apart by ``; ``."""
    return "; ".join(coverage_lines(coverage))
