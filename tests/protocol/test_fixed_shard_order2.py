"""Fixed shards in epoch order 2 (issue 41): a fixed shard ``I/N``'s key ends in ``:o2`` and its lazy order orders
the stream's own records ``k`` (its dataset shards ``j % N == I`` laid end to end), so a trainer keeps ranges of
the stream's epoch positions and a producer turns a hello's ranges back into its per-record bookkeeping without
ever ordering the dataset."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.protocol.epochs import stream_progress
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.epochs.stream_progress import consumed_records
from stoker.protocol.input_state import InputState, RangeProgress, StreamKey, TooManyRecordsError


@st.composite
def fixed_keys(draw: st.DrawFn) -> StreamKey:
    count = draw(st.integers(1, 6))
    block = draw(st.sampled_from([0, 1, 7, 64]))
    shards = draw(st.integers(count, 3 * count + 2))  # at least one shard per stream: none serves nothing
    records = draw(st.integers(max(1, (shards - 1) * block + 1), shards * block)) if block else draw(
        st.integers(count, 400))
    text = (f"{draw(st.integers(0, count - 1))}/{count}:{records}:{draw(st.integers(-5, 2**31))}"
            f"{f':{block}x{draw(st.integers(1, 4))}' if block else ''}:o2")
    return StreamKey.parse(text)


@settings(max_examples=60, deadline=None)
@given(key=fixed_keys(), epoch=st.integers(0, 3))
def test_positions_and_records_of_a_fixed_shard_round_trip_within_the_stream(key, epoch):
    assert StreamKey.parse(str(key)) == key and key.order_version == 2 and not key.splits
    order = key.order(epoch)  # the stream's records in epoch order: each of its records once, none of another's
    assert np.array_equal(np.sort(order), key.stream_records()) and key.owns(order).all()
    assert len(order) == key.size == key.lazy_order().table.records
    assert np.array_equal(key.positions(epoch, order), np.arange(key.size))
    k = np.arange(key.size, dtype=np.int64)
    assert np.array_equal(key.local(key.records_of(k)), k)  # local k <-> dataset record
    cut = key.size // 3
    assert np.array_equal(key.records_at(epoch, cut, key.size), order[cut:])
    if key.block:  # a window of the stream's order reads at most W of its shards: its two-level shuffle holds
        shards = key.lazy_order().shard_at(epoch, np.arange(key.size))
        starts = key.lazy_order().window_starts(epoch)
        window = np.searchsorted(starts, np.arange(key.size), side="right") - 1
        assert all(len(np.unique(shards[window == w])) <= key.window for w in np.unique(window))


def test_a_fixed_shard_of_a_web_scale_dataset_orders_only_its_own_shards():
    """7/100 of 10^10 records in shards of 10^4: of the dataset's 10^6 shards the stream holds 10^4, and a batch's
    positions come from a plan of those (a few hundred KB), never from the dataset's order or its table."""
    key = StreamKey.parse("7/100:10000000000:3:10000x8:o2")
    assert key.size == 10**8 and key.lazy_order().table.shards == 10**4
    records = key.records_of(np.array([0, 9_999, 10_000, 55_555_555, 10**8 - 1]))
    assert key.owns(records).all() and (records // 10_000 % 100 == 7).all()
    tracemalloc.start()
    try:
        positions = key.positions(4, records)
        back = key.records_at(4, int(positions[0]), int(positions[0]) + 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert back[0] == records[0] and peak < 4 << 20, peak
    assert np.array_equal(key.lazy_order().at(4, positions), key.local(records))
    with pytest.raises(TooManyRecordsError, match="fixed shard 0/2:"):
        StreamKey.parse("0/2:10000000000:3:10000x8:o2").order(0)  # 5 * 10^9 records of the stream: never whole


def test_a_fixed_shards_state_keeps_ranges_of_its_positions_and_round_trips():
    key = StreamKey.parse("1/2:5000:9:100x2:o2")
    state = InputState()
    served = key.order(0)[:1200]  # what a producer serves first: the order's prefix, so one range
    state.mark(str(key), np.zeros(len(served), np.int64), served)
    progress = state.streams[str(key)]
    assert isinstance(progress, RangeProgress) and progress.size == key.size == 2500
    assert progress.open[0].range_count == 1 and progress.consumed_in(0) == 1200
    again = InputState.from_bytes(state.to_bytes())
    assert again.streams[str(key)].open[0] == progress.open[0]
    state.mark(str(key), [0], [150])  # dataset shard 1: stream 1/2's
    with pytest.raises(ValueError, match="outside shard"):
        state.mark(str(key), [0], [50])  # dataset shard 0: stream 0/2's


@settings(max_examples=30, deadline=None)
@given(key=fixed_keys(), epoch=st.integers(0, 2), data=st.data())
def test_a_hellos_ranges_become_the_consumed_records_of_the_stream(key, epoch, data, monkeypatch_chunk):
    consumed = PositionRanges.from_bitmap(np.array(data.draw(st.lists(st.booleans(), min_size=key.size,
                                                                     max_size=key.size)), bool))
    bitmap = consumed_records(consumed, key.lazy_order(), epoch)
    expected = np.zeros(key.size, bool)
    expected[key.local(key.order(epoch)[consumed.to_bitmap()])] = True
    assert np.array_equal(bitmap, expected)


@pytest.fixture(scope="module")
def monkeypatch_chunk():
    """Chunks of 5 positions: long runs and many short ranges both cross chunk boundaries."""
    saved, stream_progress.RECORDS_CHUNK = stream_progress.RECORDS_CHUNK, 5
    yield
    stream_progress.RECORDS_CHUNK = saved


def test_ranges_of_another_stream_are_refused():
    with pytest.raises(ValueError, match="do not belong to a stream of 2500"):
        consumed_records(PositionRanges(5000), StreamKey.parse("1/2:5000:9:100x2:o2").lazy_order(), 0)
