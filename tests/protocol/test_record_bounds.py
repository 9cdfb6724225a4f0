"""Record indices to 2**40 everywhere the protocol names a record (issue 41), and memory bounded by what a message
or state expands to, never by the size of the dataset it names.

Peak memory is measured with tracemalloc (NumPy reports its buffers to it): a bound on bytes, not on time.
"""

from __future__ import annotations

import tracemalloc
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.protocol import ProtocolError, decode_batch, encode_batch
from stoker.protocol.exact_messages import (MAX_SPLIT, Credit, Hello, Status, Work, WorkItem, decode_status,
                                            decode_trainer_message, encode_credit, encode_hello, encode_status,
                                            encode_work)
from stoker.protocol.input_state import (FORMAT, MAX_MATERIALISED_RECORDS, MAX_RECORDS, MAX_STATE_BITS, VERSION,
                                         InputState, StreamKey, StreamProgress, TooManyRecordsError,
                                         check_materialisable)

TOP = MAX_RECORDS - 1  # the largest record index
#: What refusing a huge stream may cost at most: far below one bitmap of the 10**8-record streams used here
#: (12.5 MB packed, 100 MB unpacked), let alone one of 2**40 records.
SMALL_PEAK = 8 << 20


def _peak(action) -> tuple[int, BaseException | None]:
    """Peak bytes traced while ``action()`` runs, and what it raised."""
    tracemalloc.start()
    raised = None
    try:
        action()
    except Exception as exc:  # the callers assert on what was raised
        raised = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, raised


# ---- stream keys ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [f"splits:{MAX_RECORDS}:3", f"0/4:{MAX_RECORDS}:3", f"3/4:{MAX_RECORDS}:-1:1024x8",
                                  f"splits:{MAX_RECORDS}:0:{MAX_RECORDS}x1"])
def test_a_key_of_2_to_the_40_records_parses_and_says_itself_again(text):
    key = StreamKey.parse(text)
    assert key.records == MAX_RECORDS and str(key) == text
    assert key.size <= MAX_RECORDS  # counted, not materialised


@pytest.mark.parametrize("text, message", [
    (f"splits:{MAX_RECORDS + 1}:3", "invalid dataset size"),
    (f"0/4:{MAX_RECORDS + 1}:3", "invalid shard"),
    (f"0/4:1000:3:{MAX_RECORDS + 1}x8", "invalid shard layout"),
])
def test_a_key_of_more_than_2_to_the_40_records_is_refused_naming_why(text, message):
    with pytest.raises(ValueError, match=message):
        StreamKey.parse(text)


def test_a_huge_fixed_shard_places_records_near_2_to_the_40_without_arrays_of_its_size():
    key = StreamKey.parse(f"1/4:{MAX_RECORDS}:0:1000x1")  # shards of 1000 records, every 4th from shard 1
    late = MAX_RECORDS // 1000 - 2  # a whole shard near the end, served by 1/4
    assert late % 4 == 1
    indices = np.array([1000, 1999, 5000, late * 1000 + 7], np.int64)
    assert key.owns(indices).all() and not key.owns(np.array([0, TOP + 1])).any()
    np.testing.assert_array_equal(key.local(indices), [0, 999, 1000, late // 4 * 1000 + 7])


def test_order_1_refuses_a_dataset_over_its_limit_before_allocating_and_names_the_way_out():
    key = StreamKey.parse(f"splits:{MAX_RECORDS}:0")
    for build in (lambda: key.order(0), key.stream_records, lambda: StreamProgress(key.size).consumed(0),
                  lambda: InputState().mark(str(key), [0], [TOP])):
        peak, raised = _peak(build)
        assert isinstance(raised, TooManyRecordsError) and "order 2 (lazy) is needed beyond" in str(raised)
        assert peak < SMALL_PEAK
    check_materialisable(MAX_MATERIALISED_RECORDS, "at the limit")  # 10**8 itself is order 1's
    with pytest.raises(TooManyRecordsError, match="100,000,001 records: epoch order 1 keeps one entry per record"):
        StreamKey.parse(f"0/1000:{MAX_MATERIALISED_RECORDS + 1}:0").check_materialisable()


# ---- control messages -------------------------------------------------------------------------------------------

def test_credit_work_hello_and_status_carry_record_indices_near_2_to_the_40():
    key = f"splits:{MAX_RECORDS}:0"
    credit = Credit(3, 2, [(0, [TOP, TOP - 1, 0]), (1, [2**39])])
    assert decode_trainer_message(encode_credit(credit)) == credit
    work = Work(4, [WorkItem(0, MAX_RECORDS - MAX_SPLIT, MAX_RECORDS, [0, MAX_SPLIT - 1])])
    assert decode_trainer_message(encode_work(work)) == work
    # A state of a 2**40-record stream with its epochs all complete: no bitmap, so nothing to refuse.
    state = InputState({key: StreamProgress(MAX_RECORDS, completed=7)})
    hello = decode_trainer_message(encode_hello(Hello("t", 1, 4, state, {key: [(7, [TOP, 5])]})))
    assert hello.held == {key: [(7, [TOP, 5])]} and hello.state.streams[key].completed == 7
    status = Status(key, "p", 7, None, False, cache=MAX_RECORDS - 1, held=[TOP, 0])
    decoded = decode_status(msgpack.unpackb(encode_status(status)))
    assert (decoded.stream, decoded.cache, decoded.held) == (key, MAX_RECORDS - 1, [TOP, 0])


@pytest.mark.parametrize("body, message", [
    ({"t": "credit", "session": 1, "n": 1, "consumed": [[0, [MAX_RECORDS]]]}, r"in \[0, 2\*\*40\)"),
    ({"t": "credit", "session": 1, "n": 1, "consumed": [[0, [2**64 - 1]]]}, r"in \[0, 2\*\*40\)"),
    ({"t": "credit", "session": 1, "n": 1, "consumed": [[0, [-1, TOP]]]}, r"in \[0, 2\*\*40\)"),
    ({"t": "work", "session": 1, "items": [[0, MAX_RECORDS, MAX_RECORDS + 1, []]]}, "work 'start'"),
    ({"t": "work", "session": 1, "items": [[0, MAX_RECORDS - 1, MAX_RECORDS + 1, []]]}, "work 'end'"),
])
def test_indices_at_or_past_2_to_the_40_are_refused_naming_the_field(body, message):
    with pytest.raises(ProtocolError, match=message):
        decode_trainer_message(msgpack.packb(body))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, TOP), min_size=1, max_size=64), st.integers(0, 2**31 - 1))
def test_any_indices_below_2_to_the_40_round_trip_in_a_credit(indices, epoch):
    credit = Credit(1, 1, [(epoch, indices)])
    assert decode_trainer_message(encode_credit(credit)) == credit


def test_a_batch_carries_indices_near_2_to_the_40_unchanged():
    index = np.array([0, 2**31, 2**32 + 1, TOP - 1, TOP], np.int64)  # past int32 and uint32, up to 2**40 - 1
    batch = decode_batch([bytes(f) for f in encode_batch({"index": index, "epoch": np.zeros(5, np.int32)},
                                                         producer="p", seq=0)])
    assert batch["index"].dtype == np.int64
    np.testing.assert_array_equal(batch["index"], index)


# ---- input states: what they may expand to ----------------------------------------------------------------------

def _state(streams: dict) -> dict:
    return {"format": FORMAT, "version": VERSION, "streams": streams}


def test_a_state_naming_a_2_to_the_40_stream_with_an_open_epoch_is_refused_before_allocating():
    # 64 MiB of zeros, compressed: without the check first, decompressing it would allocate those 64 MiB.
    packed = zlib.compress(bytes(64 << 20), 9)
    wire = _state({f"splits:{MAX_RECORDS}:0": {"completed": 0, "open": {0: packed}}})
    peak, raised = _peak(lambda: InputState.from_wire(wire))
    assert isinstance(raised, TooManyRecordsError) and "order 2 (lazy)" in str(raised) and peak < SMALL_PEAK
    frame = encode_hello(Hello("t", 1, 4, InputState()))
    body = msgpack.unpackb(frame)
    body["state"] = wire
    peak, raised = _peak(lambda: decode_trainer_message(msgpack.packb(body, use_bin_type=True)))
    assert isinstance(raised, ProtocolError) and "hello 'state'" in str(raised) and peak < SMALL_PEAK


def test_streams_times_their_sizes_cannot_multiply_into_a_huge_allocation():
    size = MAX_MATERIALISED_RECORDS  # each stream is order 1's largest, each bitmap valid (all zeros)
    packed = zlib.compress(bytes(size // 8), 9)
    streams = -(-MAX_STATE_BITS // size) + 1  # one more than the bound allows: 11 x 10**8 bits, over 2**30
    wire = _state({f"0/1:{size}:{seed}": {"completed": 0, "open": {0: packed}} for seed in range(streams)})
    peak, raised = _peak(lambda: InputState.from_wire(wire))
    assert isinstance(raised, ValueError) and f"over {MAX_STATE_BITS:,}" in str(raised)
    assert peak < SMALL_PEAK  # nothing was unpacked: one bitmap alone is 12.5 MB before unpacking
    # The same streams with their epochs complete expand to nothing and load.
    done = _state({f"0/1:{size}:{seed}": {"completed": 3, "open": {}} for seed in range(streams)})
    assert len(InputState.from_wire(done).streams) == streams


def test_a_state_whose_stream_key_is_not_a_string_is_refused_as_a_value_error():
    with pytest.raises(ValueError, match="stream key 7 is not a string"):
        InputState.from_wire(_state({7: {"completed": 0, "open": {}}}))


def test_an_order_2_key_its_lazy_order_cannot_hold_is_refused_when_parsed_or_made():
    """One shard of 2**33 records (no layout) was accepted, and the first work message then failed in LazyOrder,
    on the producer's forwarder thread and in the trainer's control plane. Now the key itself is refused."""
    with pytest.raises(ValueError, match="epoch order 2 orders shards of at most 4,294,967,295 records"):
        StreamKey.parse(f"splits:{2**33}:1:o2")
    with pytest.raises(ValueError, match="at most 16,777,216 of them"):
        StreamKey(0, 1, 2**40, 1, splits=True, block=1000, window=1, order_version=2)
    assert StreamKey.parse(f"splits:{2**33}:1:1000x1:o2").lazy_order().table.shards == 2**33 // 1000 + 1
    assert StreamKey.parse(f"splits:{2**33}:1").order_version == 1  # order 1 refuses elsewhere, by its own limit


def test_the_ranges_of_all_open_epochs_together_are_bounded(monkeypatch):
    """The budget of ranges is the state's, all epochs together: once spent, another epoch's ranges are refused (it
    let one more range per epoch through before)."""
    import numpy as np

    from stoker.protocol import input_state
    from stoker.protocol.epochs.position_ranges import PositionRanges

    key = "splits:1000:1:o2"
    four = PositionRanges.from_ranges(np.array([0, 10, 20, 30]), np.array([5, 15, 25, 35]), 1000)
    single = PositionRanges.from_ranges(np.array([0]), np.array([1]), 1000)
    monkeypatch.setattr(input_state, "MAX_STATE_RANGES", 8)
    two = input_state.InputState({key: input_state.RangeProgress(1000, 0, {0: four, 1: four})}).to_bytes()
    assert input_state.InputState.from_bytes(two).streams[key].open[1] == four
    three = input_state.InputState({key: input_state.RangeProgress(1000, 0, {0: four, 1: four, 2: single})})
    with pytest.raises(ValueError, match="more than 8 ranges"):
        input_state.InputState.from_bytes(three.to_bytes())
    with pytest.raises(ValueError, match="ends before it starts"):
        PositionRanges.from_ranges(np.array([5]), np.array([4]), 1000)
