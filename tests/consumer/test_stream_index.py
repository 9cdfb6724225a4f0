"""StreamIndex: the producers a stream may overlap, found without comparing with every producer (issue 41)."""

from hypothesis import given, settings, strategies as st

from stoker.consumer.receive.stats import shard_conflict
from stoker.consumer.receive.stream_index import StreamIndex

_fixed = st.builds(lambda i, n, r, s, b: f"{i % n}/{n}:{r}:{s}" + (f":{b}x1" if b else ""),
                   st.integers(0, 3), st.integers(1, 3), st.sampled_from([100, 200]), st.integers(0, 1),
                   st.sampled_from([0, 10]))
_pool = st.builds(lambda r, s: f"splits:{r}:{s}", st.sampled_from([100, 200]), st.integers(0, 1))
_stream = st.one_of(_fixed, _pool, st.just("not a stream"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), _stream), min_size=1, max_size=12))
def test_candidates_hold_every_overlap(puts):
    """Whatever producers serve (streams moved, pools, strangers), every producer that overlaps one's stream is
    among its candidates, and no producer is its own."""
    index, now = StreamIndex(), {}
    for producer, stream in puts:
        index.put(producer, stream)
        now[producer] = stream
    for producer, stream in now.items():
        found = index.candidates(producer)
        assert producer not in found
        overlapping = {o for o, s in now.items() if o != producer and shard_conflict(producer, stream, o, s)}
        assert overlapping <= set(found)


def test_a_fleet_of_distinct_shards_has_no_candidates():
    index = StreamIndex()
    for i in range(1024):
        index.put(f"p{i}", f"{i}/1024:262144:0")
    assert all(index.candidates(f"p{i}") == [] for i in range(0, 1024, 97))
    index.put("again", "5/1024:262144:0")  # the same shard and seed: an overlap
    assert index.candidates("again") == ["p5"]
