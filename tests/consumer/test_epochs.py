"""Epochs one at a time (``inp.epochs()``): batches split where an epoch ends, ranks ending each epoch together.

The splitting and padding are tested as plain functions; the loop with real producers of an elastic pool, whose
batches do span epochs (a producer fills every batch) and whose later epochs arrive before an earlier one's last
records. Two ranks are two ``BatchStream`` shares in threads agreeing through a barrier (the torchrun job is in
test_torch_epochs.py). Every assertion is about which records each epoch handed out, never about timing.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.epochs.held_rows import HeldBatches, Rows, padding_arrays
from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.producer.process import ProducerProcess
from stoker.protocol.batch_spec import BatchSpec

pytestmark = pytest.mark.timeout(180)

RECORDS = 100  # batches of 8: 13 splits (the last of 4), so two ranks hold 7 and 6, and epochs end mid-batch
BATCH = 8
EPOCHS = 3
ARGS = ["--shard", "auto", "--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--seed", "5",
        "--epochs", str(EPOCHS)]


def _batch(epochs: list[int]) -> tuple[dict, Rows]:
    n = len(epochs)
    batch = {"x": np.arange(n) * 10, "epoch": np.array(epochs, np.int32), "index": np.arange(n)}
    return batch, Rows(7, np.array(epochs, np.int32), np.arange(n))


def test_a_batch_spanning_an_epoch_boundary_hands_out_its_epoch_now_and_holds_the_next_epochs_rows():
    held = HeldBatches()
    held.add(*_batch([1, 2, 1, 2]))
    held.add(*_batch([2, 2]))
    held.add(*_batch([]))  # all padding: nothing to hold
    assert len(held) == 2
    batch, rows = held.take(1)
    assert batch["x"].tolist() == [0, 20] and rows.indices.tolist() == [0, 2] and rows.source == 7
    assert held.take(1) is None  # epoch 1 has nothing more here; epoch 2's rows wait, in arrival order
    batch, rows = held.take(2)
    assert batch["x"].tolist() == [10, 30] and rows.epochs.tolist() == [2, 2]
    batch, rows = held.take(2)
    assert batch["x"].tolist() == [0, 10]
    assert len(held) == 0 and held.take(5) is None


def test_rows_of_an_older_epoch_still_open_go_with_the_current_one():
    held = HeldBatches()
    held.add(*_batch([3, 4]))
    batch, rows = held.take(4)
    assert rows.epochs.tolist() == [3, 4] and len(held) == 0


def test_a_padding_batch_is_one_row_that_is_no_record():
    spec = BatchSpec.from_dict({"images": ("uint8", [8, 4, 4, 3]), "labels": ("int32", [8]), "index": ("int64", [8]),
                                "epoch": ("int32", [8]), "mask": ("bool", [8])})
    pad = padding_arrays(spec, 5)
    assert pad["images"].shape == (1, 4, 4, 3) and pad["images"].dtype == np.uint8 and not pad["images"].any()
    assert pad["index"].tolist() == [-1] and pad["epoch"].tolist() == [5] and pad["mask"].tolist() == [False]


@pytest.fixture(scope="module")
def lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("epochs") / "ds"
    build_synthetic(path, RECORDS, seed=1, num_classes=4, progress=False)
    return path


def _epochs_of(stream: BatchStream, sync=None, pad_after: float = 5.0) -> list[dict]:
    """Per epoch: its number, the (epoch, index) rows handed out, its steps and padding steps, the job's count."""
    out = []
    for epoch, batches in stream.epochs(sync, pad_after=pad_after):
        rows, steps, padding, order = [], 0, 0, ""
        for batch in batches:
            steps += 1
            if not batch["mask"].any():
                padding += 1
                order += "p"
                assert batch["index"].tolist() == [-1]
                continue
            order += "r"
            assert batch["mask"].all()
            rows += list(zip(batch["epoch"].tolist(), batch["index"].tolist()))
        out.append({"epoch": epoch, "rows": rows, "steps": steps, "padding": padding, "order": order,
                    "consumed": stream.consumed_epochs, "job": stream.job_consumed_epochs})
    return out


def _once(rows: list[tuple[int, int]], epoch: int) -> None:
    counts = Counter(index for _, index in rows)
    assert {e for e, _ in rows} == {epoch}
    assert sorted(counts) == list(range(RECORDS)), f"missing {sorted(set(range(RECORDS)) - set(counts))}"
    assert set(counts.values()) == {1}


def test_one_trainer_iterates_each_epoch_of_a_pool_with_each_record_once_and_stops_after_the_last(lmdb):
    producers = [ProducerProcess(lmdb, extra_args=ARGS) for _ in range(2)]
    try:
        with BatchStream([p.endpoint for p in producers], exact=True, recv_timeout=60) as stream:
            epochs = _epochs_of(stream)
            with pytest.raises(RuntimeError, match="called already"):
                stream.epochs()
    finally:
        for producer in producers:
            producer.stop()
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
    for e in epochs:
        _once(e["rows"], e["epoch"])
        assert e["padding"] == 0 and e["consumed"] == e["job"] == e["epoch"] + 1


class BarrierSync:
    """Two threads' ``EpochSync``: each call gathers every rank's value through a barrier (bounded)."""

    def __init__(self, rank: int, values: list, barrier: threading.Barrier) -> None:
        self.rank, self.values, self.barrier = rank, values, barrier

    def _gather(self, value: int) -> list[int]:
        self.values[self.rank] = value
        self.barrier.wait(60)
        seen = list(self.values)
        self.barrier.wait(60)
        return seen

    def any(self, flag: bool) -> bool:
        return any(self._gather(int(flag)))

    def min(self, value: int) -> int:
        return min(self._gather(value))


def _two_ranks(endpoints: list[str], shares: bool, pad_after: float) -> list[list[dict]]:
    """Two ranks (threads, each a ``BatchStream``; ``shares``: an elastic pool's ``(rank, 2)``) iterating every
    epoch, agreeing through a barrier: what ``_epochs_of`` saw on each. Fails naming a rank's error."""
    values, barrier = [0, 0], threading.Barrier(2)
    results: list = [None, None]

    def rank(r: int) -> None:
        try:
            share = {"share": (r, 2)} if shares else {}
            with BatchStream(endpoints, exact=True, recv_timeout=60, **share) as stream:
                results[r] = _epochs_of(stream, BarrierSync(r, values, barrier), pad_after)
        except BaseException as exc:  # the test names it
            barrier.abort()
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert not any(isinstance(r, BaseException) or r is None for r in results), results
    assert [e["epoch"] for e in results[0]] == [e["epoch"] for e in results[1]] == list(range(EPOCHS))
    for a, b in zip(*results):
        assert a["steps"] == b["steps"]  # every rank steps as often: a collective per step never hangs
        assert a["job"] == b["job"] == a["epoch"] + 1
        _once(a["rows"] + b["rows"], a["epoch"])
    return results


def test_two_ranks_with_uneven_shares_end_every_epoch_together_padding_the_shorter_one(lmdb):
    producers = [ProducerProcess(lmdb, extra_args=ARGS) for _ in range(2)]
    try:
        # patient for ever (as a pool allows): whether a rank pads then depends on its share alone, not on timing
        first, second = _two_ranks([p.endpoint for p in producers], shares=True, pad_after=float("inf"))
    finally:
        for producer in producers:
            producer.stop()
    for a, b in zip(first, second):
        assert a["rows"] and b["rows"]
        # a rank pads only once its share ran out, and only while the other still trains: the longer one never
        assert all(e["order"] == "r" * (e["steps"] - e["padding"]) + "p" * e["padding"] for e in (a, b))
        assert min(a["padding"], b["padding"]) == 0


def test_two_ranks_sharing_one_fixed_shard_producer_end_every_epoch_together_without_a_hang(lmdb):
    """Ranks that share a fixed shard cannot know their share is done until the shard's whole epoch is consumed,
    which may need records the other rank holds: they are waited for at most ``pad_after``, then pad."""
    producer = ProducerProcess(lmdb, extra_args=["--exact", "--shard", "0/1", *ARGS[2:]])
    try:
        _two_ranks([producer.endpoint], shares=False, pad_after=0.5)
    finally:
        producer.stop()
