"""A fixed shard's serving logic in epoch order 2 (issue 41), no sockets: it serves its stream in the stream's lazy
order, and a restarted producer resumes from a hello whose state holds ranges of epoch positions."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.producer.serve.policies.fixed_shards import FixedShardPolicy
from stoker.protocol.exact_messages import Credit, Hello
from stoker.protocol.input_state import InputState, RangeProgress, StreamKey

KEYS = [StreamKey.parse("1/3:1000:5:64x2:o2"), StreamKey.parse("0/2:41:5:o2")]  # a layout, and none (one block)


def _serve_all(server: FixedShardPolicy, routing: bytes, n: int) -> list[int]:
    served = []
    while (chunk := server.next_chunk(n)) is not None:
        server.on_sent(routing, chunk.epochs, chunk.indices)
        served.extend(chunk.indices)
    return served


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_an_epoch_is_served_in_the_streams_lazy_order_each_record_once(key):
    server = FixedShardPolicy(key, "p", epochs=1)
    server.on_hello(b"a", Hello("t", 1, 100, InputState(), {}))
    served = _serve_all(server, b"a", 7)
    assert served == key.order(0).tolist() and key.owns(served).all()
    server.on_credit(b"a", Credit(1, 1, [(0, served)]))
    assert server.finished


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_a_restarted_producer_serves_only_what_the_hellos_ranges_leave(key):
    first = FixedShardPolicy(key, "p")
    first.on_hello(b"a", Hello("t", 1, 100, InputState(), {}))
    chunks = [first.next_chunk(9) for _ in range(3)]
    state = InputState()
    for chunk in chunks[:2]:  # two batches consumed; the third was held by the trainer
        state.mark(str(key), chunk.epochs, chunk.indices)
    state.mark(str(key), [0], [chunks[2].indices[0]])  # ... and one record of it consumed since: a hole after
    assert isinstance(state.streams[str(key)], RangeProgress)
    second = FixedShardPolicy(key, "p", epochs=1)  # knows nothing but the hello
    second.on_hello(b"a", Hello("t", 2, 100, state, {str(key): [(0, chunks[2].indices[1:])]}))
    rest = _serve_all(second, b"a", 9)
    done = {i for c in chunks for i in c.indices}
    assert sorted(rest) == sorted(set(key.stream_records().tolist()) - done) and len(rest) == len(set(rest))
    assert rest == [i for i in key.order(0).tolist() if i not in done]  # on in the epoch's order
