"""PositionRanges against a model (a Python set and a bool array), its edges, and its wire parser under attack."""

from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stoker.protocol.epochs.position_ranges import MAX_LIMIT, PositionRanges
from stoker.protocol.epochs.varints import encode_varints

LIMIT = 160  # small enough for the model, large enough for many ranges and holes


def _model_ranges(members: set[int]) -> PositionRanges:
    bitmap = np.zeros(LIMIT, bool)
    bitmap[sorted(members)] = True
    return PositionRanges.from_bitmap(bitmap)


def _assert_canonical(ranges: PositionRanges) -> None:
    starts, ends = ranges.starts, ranges.ends
    assert starts.dtype == ends.dtype == np.int64 and len(starts) == len(ends) == ranges.range_count
    assert (starts < ends).all(), "an empty range was kept"
    assert (ends[:-1] < starts[1:]).all(), "ranges overlap or touch: not merged"
    assert len(starts) == 0 or (starts[0] >= 0 and ends[-1] <= ranges.limit)
    assert ranges.count() == int((ends - starts).sum())


positions = st.lists(st.integers(0, LIMIT - 1), max_size=40)
spans = st.tuples(st.integers(0, LIMIT), st.integers(0, LIMIT)).map(sorted)


class AgainstASet(RuleBasedStateMachine):
    """Every operation on PositionRanges answers as the same operation on a Python set of ints."""

    @initialize()
    def start_empty(self):
        self.ranges, self.model = PositionRanges(LIMIT), set()

    @rule(batch=positions)
    def add(self, batch):
        new = self.ranges.add(np.array(batch, np.int64))
        assert new == len(set(batch) - self.model)
        self.model |= set(batch)

    @rule(span=spans)
    def add_range(self, span):
        new = self.ranges.add_range(*span)
        assert new == len(set(range(*span)) - self.model)
        self.model |= set(range(*span))

    @rule(other=positions)
    def union(self, other):
        merged = self.ranges.union(_model_ranges(set(other)))
        assert merged.to_bitmap().nonzero()[0].tolist() == sorted(self.model | set(other))
        _assert_canonical(merged)

    @rule(probe=st.lists(st.integers(-3, LIMIT + 3), max_size=20))
    def contains(self, probe):
        assert self.ranges.contains(np.array(probe, np.int64)).tolist() == [p in self.model for p in probe]

    @rule(span=spans)
    def queries_of_a_span(self, span):
        inside = [p for p in range(*span) if p in self.model]
        assert self.ranges.covers(*span) == (len(inside) == span[1] - span[0])
        assert self.ranges.within(*span).tolist() == inside
        gap_starts, gap_ends = self.ranges.missing(*span)
        gaps = [p for s, e in zip(gap_starts.tolist(), gap_ends.tolist()) for p in range(s, e)]
        assert gaps == [p for p in range(*span) if p not in self.model]
        assert (gap_starts < gap_ends).all() and (gap_ends[:-1] < gap_starts[1:]).all()

    @rule(start=st.integers(0, LIMIT))
    def first_missing(self, start):
        assert self.ranges.first_missing(start) == next((p for p in range(start, LIMIT) if p not in self.model),
                                                       LIMIT)

    @rule()
    def wire_round_trip(self):
        again = PositionRanges.from_wire(self.ranges.to_wire(), LIMIT)
        assert again == self.ranges and again.count() == self.ranges.count()

    @precondition(lambda self: self.model)
    @rule()
    def copy_is_independent(self):
        twin = self.ranges.copy()
        twin.add_range(0, LIMIT)
        assert twin.is_full() and self.ranges.count() == len(self.model)

    @invariant()
    def canonical_and_same_as_the_model(self):
        _assert_canonical(self.ranges)
        assert self.ranges.count() == len(self.model)
        assert self.ranges.is_full() == (len(self.model) == LIMIT)
        assert self.ranges == _model_ranges(self.model), "not the one canonical form of the model's set"


AgainstASet.TestCase.settings = settings(max_examples=120, stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_position_ranges_answer_as_a_set = AgainstASet.TestCase


@settings(max_examples=150, deadline=None)
@given(st.lists(st.booleans(), max_size=300))
def test_bitmap_round_trip_and_wire_round_trip_of_any_bitmap(bits):
    bitmap = np.array(bits, bool)
    ranges = PositionRanges.from_bitmap(bitmap)
    _assert_canonical(ranges)
    assert ranges.to_bitmap().tolist() == bits
    assert PositionRanges.from_wire(ranges.to_wire(), len(bits)) == ranges


def test_empty_sets_and_limits_0_and_1():
    for limit in (0, 1):
        empty = PositionRanges(limit)
        assert empty.count() == 0 and empty.range_count == 0 and empty.is_full() == (limit == 0)
        assert empty.first_missing() == 0 and empty.covers(0, 0) and empty.within(0, limit).tolist() == []
        assert empty.contains(np.array([0, 1])).tolist() == [False, False]
        assert PositionRanges.from_wire(empty.to_wire(), limit) == empty
        assert empty.add(np.zeros(0, np.int64)) == 0
    one = PositionRanges(1)
    assert one.add(np.array([0, 0])) == 1 and one.is_full() and one.first_missing() == 1
    assert one.missing(0, 1)[0].tolist() == [] and PositionRanges.from_wire(one.to_wire(), 1) == one
    with pytest.raises(ValueError, match="outside"):
        PositionRanges(0).add(np.array([0]))


def test_the_last_position_and_a_full_set():
    ranges = PositionRanges(10)
    assert ranges.add(np.array([9])) == 1 and ranges.first_missing(9) == 10 and ranges.covers(9, 10)
    assert ranges.add_range(0, 9) == 9 and ranges.is_full() and ranges.range_count == 1
    assert ranges.missing(0, 10)[0].size == 0 and ranges.add_range(0, 10) == 0
    with pytest.raises(ValueError, match="outside"):
        ranges.add(np.array([3, 10]))


def test_far_apart_ranges_under_2_to_the_40_cost_what_their_count_does():
    ranges = PositionRanges(MAX_LIMIT)
    ranges.add_range(0, 1 << 39)
    ranges.add(np.array([MAX_LIMIT - 1, MAX_LIMIT - 3, 700_000_000_000], np.uint64))
    assert ranges.range_count == 4 and ranges.count() == (1 << 39) + 3
    assert ranges.first_missing(0) == 1 << 39 and ranges.first_missing(MAX_LIMIT - 1) == MAX_LIMIT
    assert ranges.within(MAX_LIMIT - 4, MAX_LIMIT).tolist() == [MAX_LIMIT - 3, MAX_LIMIT - 1]
    wire = ranges.to_wire()
    assert len(wire) < 64 and PositionRanges.from_wire(wire, MAX_LIMIT) == ranges
    with pytest.raises(ValueError, match="past the limit"):
        PositionRanges.from_wire(wire, MAX_LIMIT - 1)


def test_bad_arguments_name_what_was_wrong_and_leave_the_set_unchanged():
    ranges = PositionRanges(100)
    ranges.add_range(10, 20)
    with pytest.raises(ValueError, match="position -1 is outside"):
        ranges.add(np.array([50, -1]))
    with pytest.raises(ValueError, match="position 100 is outside"):
        ranges.add(np.array([50, 100], np.uint64))
    with pytest.raises(TypeError, match="integer"):
        ranges.add(np.array([1.5]))
    for bad in ((5, 4), (-1, 3), (0, 101)):
        with pytest.raises(ValueError, match="not a range within"):
            ranges.covers(*bad)
    with pytest.raises(TypeError, match="must be ints"):
        ranges.within(1.5, 3)
    with pytest.raises(ValueError, match="limit"):
        PositionRanges(MAX_LIMIT + 1)
    with pytest.raises(ValueError, match="same limit"):
        ranges.union(PositionRanges(99))
    assert ranges.count() == 10 and ranges.range_count == 1


# --- the wire parser ---------------------------------------------------------------------------------------

def _wire(values: list[int]) -> bytes:
    return zlib.compress(encode_varints(np.array(values, np.uint64)))


@pytest.mark.parametrize("payload, what", [
    (b"\x05\x85", "truncated varint"),
    (b"\x05", "length is missing"),
    (b"\x05\x00", "zero-length range"),
    (b"\x05\x02\x00\x01", "zero gap"),
    (b"\x80\x80\x80\x80\x80\x80\x01\x01", "longer than 6 bytes"),
    (b"\x85\x00\x01", "non-minimal"),
    (b"\x60\x05", "past the limit"),
    (b"\x05\x02" * 11, "more than 10 ranges"),
])
def test_malformed_payloads_are_refused_naming_the_fault(payload, what):
    with pytest.raises(ValueError, match=what):
        PositionRanges.from_wire(zlib.compress(payload), 100, max_ranges=10)


def test_malformed_zlib_and_trailing_garbage_are_refused():
    good = _wire([3, 4])
    assert PositionRanges.from_wire(good, 100).within(0, 100).tolist() == [3, 4, 5, 6]
    for data, what in ((good + b"x", "trailing garbage"), (good[:-3], "truncated"), (b"not zlib", "not a zlib")):
        with pytest.raises(ValueError, match=what):
            PositionRanges.from_wire(data, 100)
    with pytest.raises(TypeError):
        PositionRanges.from_wire(10**12, 100)  # an int is not bytes (bytes(10**12) would allocate a TB)


def test_a_few_bytes_claiming_one_huge_range_are_one_cheap_range():
    huge = PositionRanges.from_wire(_wire([0, MAX_LIMIT]), MAX_LIMIT)
    assert huge.is_full() and huge.range_count == 1
    with pytest.raises(ValueError, match="exceeds the limit"):
        PositionRanges.from_wire(_wire([0, MAX_LIMIT]), 1000)


def _peak_bytes(call) -> int:
    tracemalloc.start()
    try:
        call()
    except ValueError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_a_zlib_bomb_is_refused_without_inflating_it():
    bomb = zlib.compress(bytes(100 * 1024 * 1024), 9)  # 100 MB of zeros in about 100 KB
    assert len(bomb) < 200_000
    with pytest.raises(ValueError, match="inflates past 12000 bytes"):
        PositionRanges.from_wire(bomb, MAX_LIMIT, max_ranges=1000)
    # memory is bounded by the cap, not by what the payload claims (100 MB)
    assert _peak_bytes(lambda: PositionRanges.from_wire(bomb, MAX_LIMIT, max_ranges=1000)) < 1_000_000


def test_many_tiny_ranges_past_max_ranges_are_refused_before_their_arrays_exist():
    many = _wire([1, 1] * 100_000)  # 100,000 ranges in 400 KB of varints, compressed to a few KB
    with pytest.raises(ValueError, match="more than 1000 ranges|inflates past"):
        PositionRanges.from_wire(many, MAX_LIMIT, max_ranges=1000)
    assert _peak_bytes(lambda: PositionRanges.from_wire(many, MAX_LIMIT, max_ranges=1000)) < 1_000_000
    assert PositionRanges.from_wire(many, MAX_LIMIT, max_ranges=100_000).range_count == 100_000


def _accepted_is_sound(data: bytes, limit: int, max_ranges: int) -> None:
    try:
        ranges = PositionRanges.from_wire(data, limit, max_ranges=max_ranges)
    except ValueError:
        return
    _assert_canonical(ranges)
    assert ranges.range_count <= max_ranges and PositionRanges.from_wire(ranges.to_wire(), limit) == ranges


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 1 << 20))
def test_random_bytes_raise_nothing_but_value_error(data, limit):
    _accepted_is_sound(data, limit, 8)
    _accepted_is_sound(zlib.compress(data), limit, 8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200), st.data())
def test_mutated_valid_encodings_raise_nothing_but_value_error(bits, data):
    ranges = PositionRanges.from_bitmap(np.array(bits, bool))
    payload = bytearray(zlib.decompress(ranges.to_wire()))
    compressed = bytearray(ranges.to_wire())
    for target in (payload, compressed):
        for _ in range(data.draw(st.integers(1, 3))):
            if target:
                target[data.draw(st.integers(0, len(target) - 1))] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            del target[data.draw(st.integers(0, len(target))):]
    _accepted_is_sound(zlib.compress(bytes(payload)), len(bits), 40)
    _accepted_is_sound(bytes(compressed), len(bits), 40)
