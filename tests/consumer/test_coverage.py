"""Coverage per shard (issue 31.1): where each producer counts its own shard's epochs, shards drift apart,
and coverage counted over the whole dataset showed every epoch half-covered while nothing was missing.

The unit tests feed ``Coverage`` real NumPy rows; the last test runs two real plain producers on shards of
different sizes (so their epochs differ by construction) into a real ``BatchStream``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.receive.coverage import Coverage, coverage_lines, coverage_text
from stoker.consumer.receive.input_stats import InputStats
from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.producer.process import ProducerProcess


def _epochs_of(shard: int, count: int, records: int, epochs: range) -> tuple[np.ndarray, np.ndarray]:
    """Every record of shard ``shard``/``count`` in each epoch of ``epochs``, epoch by epoch: (epoch, index)."""
    members = np.arange(shard, records, count)
    return np.repeat(np.array(epochs), len(members)), np.tile(members, len(epochs))


def _feed(coverage: Coverage, stream: str, epochs: np.ndarray, indices: np.ndarray, batch: int = 4) -> None:
    for start in range(0, len(epochs), batch):
        coverage.add(stream, epochs[start:start + batch], indices[start:start + batch])


def test_shards_whose_epochs_drift_apart_each_show_their_completed_epochs_whole():
    # 13 records: shard 0/2 holds 7, shard 1/2 holds 6. Shard 1/2 runs 7 epochs ahead, as a faster producer does.
    coverage = Coverage()
    slow_e, slow_i = _epochs_of(0, 2, 13, range(0, 3))
    fast_e, fast_i = _epochs_of(1, 2, 13, range(0, 10))
    slow_e, slow_i = np.append(slow_e, [3, 3]), np.append(slow_i, [4, 8])  # epoch 3 of shard 0/2 under way
    for k in range(max(len(slow_e), len(fast_e)) // 4 + 1):  # batches of the two interleaved as they arrive
        _feed(coverage, "0/2:13:5", slow_e[4 * k:4 * k + 4], slow_i[4 * k:4 * k + 4])
        _feed(coverage, "1/2:13:5", fast_e[4 * k:4 * k + 4], fast_i[4 * k:4 * k + 4])
    assert coverage.snapshot() == {("0/2", 0): (7, 7), ("0/2", 1): (7, 7), ("0/2", 2): (7, 7), ("0/2", 3): (2, 7),
                                   ("1/2", 6): (6, 6), ("1/2", 7): (6, 6), ("1/2", 8): (6, 6), ("1/2", 9): (6, 6)}
    assert coverage_lines(coverage.snapshot()) == [
        "shard 0/2, epoch 0: 7/7 (100%), epoch 1: 7/7 (100%), epoch 2: 7/7 (100%), epoch 3: 2/7 (29%)",
        "shard 1/2, epoch 6: 6/6 (100%), epoch 7: 6/6 (100%), epoch 8: 6/6 (100%), epoch 9: 6/6 (100%)"]


def test_fixed_shards_of_a_layout_count_their_whole_dataset_shards_and_another_layout_is_not_mixed_in():
    # 250 records in dataset shards of 50: shard 0/2 is dataset shards 0, 2, 4 (150 records).
    coverage = Coverage()
    mine = np.concatenate([np.arange(0, 50), np.arange(100, 150), np.arange(200, 250)])
    _feed(coverage, "0/2:250:5:50x1", np.zeros(150, np.int64), mine)
    _feed(coverage, "0/2:250:5:50x1", np.ones(3, np.int64), np.array([0, 149, 60]))  # 60: shard 1's, not counted
    assert coverage.snapshot() == {("0/2", 0): (150, 150), ("0/2", 1): (2, 150)}
    # The same shard number read flat (--shuffle-window 0: every 2nd record) is not counted into those bitmaps.
    _feed(coverage, "0/2:250:5", np.zeros(2, np.int64), np.array([0, 2]))
    assert coverage.snapshot() == {("0/2", 0): (150, 150), ("0/2", 1): (2, 150)}
    flat_first = Coverage()  # and the other way round: the flat shard's bitmaps (125 records) come first
    _feed(flat_first, "0/2:250:5", np.zeros(2, np.int64), np.array([0, 248]))
    _feed(flat_first, "0/2:250:5:50x1", np.zeros(2, np.int64), np.array([0, 249]))
    assert flat_first.snapshot() == {("0/2", 0): (2, 125)}


def test_a_whole_dataset_stream_reads_as_before_and_an_elastic_pool_is_one_coverage_labelled_all():
    for stream in ("0/1:1200:3", "splits:1200:3"):
        coverage = Coverage()
        epochs, indices = _epochs_of(0, 1, 1200, range(3, 5))
        _feed(coverage, stream, epochs[:2000], indices[:2000], batch=64)
        assert coverage.snapshot() == {("all", 3): (1200, 1200), ("all", 4): (800, 1200)}
        assert coverage_text(coverage.snapshot()) == "epoch 3: 1,200/1,200 (100%), epoch 4: 800/1,200 (67%)"
    mixed = {("all", 0): (5, 10), ("2/16", 0): (1, 1), ("10/16", 0): (1, 1)}  # a conflict the trainer warns of
    assert coverage_text(mixed) == ("whole dataset, epoch 0: 5/10 (50%); shard 2/16, epoch 0: 1/1 (100%); "
                                    "shard 10/16, epoch 0: 1/1 (100%)")


def test_memory_is_bounded_per_shard_and_shards_past_the_bound_are_counted_as_untracked():
    coverage = Coverage(epochs=2, max_shards=2)
    for shard in range(3):
        epochs, indices = _epochs_of(shard, 3, 30, range(5))
        _feed(coverage, f"{shard}/3:30:0", epochs, indices)
    assert coverage.snapshot() == {("0/3", 3): (10, 10), ("0/3", 4): (10, 10),
                                   ("1/3", 3): (10, 10), ("1/3", 4): (10, 10)}
    assert coverage.untracked_batches == 13  # shard 2/3's 50 rows in batches of 4
    late = Coverage(epochs=2)
    _feed(late, "0/1:30:0", *_epochs_of(0, 1, 30, range(5, 7)))
    _feed(late, "0/1:30:0", *_epochs_of(0, 1, 30, range(0, 1)))  # older than anything kept: not counted
    assert late.snapshot() == {("all", 5): (30, 30), ("all", 6): (30, 30)}
    huge = Coverage(max_records=1000)
    huge.add("0/2:4000:0", np.zeros(4, np.int32), np.arange(0, 8, 2))  # a 2,000-record shard: past the bound
    huge.add("0/8:4000:0", np.zeros(4, np.int32), np.arange(0, 32, 8))  # 500: tracked
    huge.add("1/8:4000:0", np.zeros(4, np.int32), np.arange(1, 33, 8))  # 500 more: still within the bound
    huge.add("2/8:4000:0", np.zeros(4, np.int32), np.arange(2, 34, 8))  # 1,500 in all: not counted
    assert huge.snapshot() == {("0/8", 0): (4, 500), ("1/8", 0): (4, 500)} and huge.untracked_batches == 2


def test_a_stream_of_2_to_the_40_records_is_counted_as_untracked_without_a_bitmap_of_its_size():
    """Issue 41: keys name datasets of up to 2**40 records; coverage keeps bitmaps only within its bound."""
    coverage = Coverage()
    top = np.array([0, 2**40 - 1], np.int64)
    coverage.add(f"splits:{2**40}:0", np.zeros(2, np.int32), top)
    coverage.add(f"3/4:{2**40}:0", np.zeros(2, np.int32), top)
    assert coverage.snapshot() == {} and coverage.untracked_batches == 2


def test_rows_of_another_dataset_or_shard_padding_and_bad_streams_are_not_counted():
    coverage = Coverage()
    coverage.add("1/4:40:0", np.zeros(6, np.int32), np.array([1, 5, 9, 2, 40, -1]))  # 2: shard 2/4's; 40, -1: none
    coverage.add("1/4:41:0", np.zeros(2, np.int32), np.array([13, 17]))  # another dataset: not this one's coverage
    coverage.add("0/4:40:0", np.zeros(3, np.int32), np.array([0, 4, 8]), rows=np.array([True, True, False]))
    for bad in ("", "nonsense", "5/4:40:0"):
        coverage.add(bad, np.zeros(1, np.int32), np.array([0]))
    assert coverage.snapshot() == {("0/4", 0): (2, 10), ("1/4", 0): (3, 10)}


def test_the_input_stats_hold_coverage_per_shard():
    assert InputStats().coverage == {}
    stats = InputStats(coverage={("0/2", 262): (32, 32)})
    assert coverage_text(stats.coverage) == "shard 0/2, epoch 262: 32/32 (100%)"


@pytest.fixture(scope="module")
def odd_lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("coverage") / "data"
    build_synthetic(path, 5, seed=4, num_classes=2, progress=False)  # shard 0/2: 3 records, shard 1/2: 2
    return path


@pytest.mark.timeout(180)
def test_two_plain_producers_on_shards_of_different_sizes_each_show_every_completed_epoch_whole(odd_lmdb: Path):
    # Batches of 4 rows: a batch of shard 0/2 (3 records) spans 1-2 of its epochs, one of shard 1/2 (2 records)
    # exactly 2 of its, so the two shards' epoch numbers part as they go, whichever producer is faster.
    args = ["--workers", "1", "--batch-size", "4", "--image-size", "16", "--seed", "1"]
    with ProducerProcess(odd_lmdb, extra_args=[*args, "--shard", "0/2"]) as p0, \
            ProducerProcess(odd_lmdb, extra_args=[*args, "--shard", "1/2"]) as p1, \
            BatchStream([p0.endpoint, p1.endpoint], recv_timeout=60, queue_capacity=2) as stream:
        batches = 0
        # Read until each producer delivered 10 batches (13+ epochs of its shard, past the 4 kept).
        while min(stream.stats.per_producer.get(p, 0) for p in (p0.producer_id, p1.producer_id)) < 10:
            next(stream)
            batches += 1
            assert batches < 5000, f"a producer never delivered: {stream.stats.per_producer}"
        coverage = stream.stats.coverage
    shards = {label for label, _ in coverage}
    assert shards == {"0/2", "1/2"}, coverage
    for label, size in (("0/2", 3), ("1/2", 2)):
        epochs = sorted(e for shard, e in coverage if shard == label)
        assert len(epochs) == 4 and epochs == list(range(epochs[0], epochs[0] + 4)), coverage  # the last 4
        assert epochs[0] > 0, coverage  # the window moved on
        assert all(coverage[label, e] == (size, size) for e in epochs[:-1]), coverage  # completed: whole
        assert 0 < coverage[label, epochs[-1]][0] <= size and coverage[label, epochs[-1]][1] == size
    for line in coverage_lines(coverage):
        assert re.fullmatch(r"shard [01]/2, (epoch \d+: \d/\d \(\d+%\)(, )?){4}", line), line


def test_a_batch_within_one_epoch_and_one_across_two_count_alike_and_a_record_twice_counts_once(monkeypatch):
    from stoker.consumer.receive import coverage as coverage_module

    monkeypatch.setattr(coverage_module, "MAX_PARSED_STREAMS", 2)  # the parsed-key cache cleared as it fills
    within, across = Coverage(), Coverage()
    for stream in ("0/1:10:1", "x-not-a-key", "0/1:10:2", "0/1:10:1"):
        within.add(stream, np.zeros(3, np.int64), np.array([1, 2, 2]))  # record 2 twice in one batch
    across.add("0/1:10:1", np.array([0, 0, 0, 1, 1]), np.array([1, 2, 2, 2, 3]))
    assert within.snapshot() == {("all", 0): (2, 10)}
    assert across.snapshot() == {("all", 0): (2, 10), ("all", 1): (2, 10)}
