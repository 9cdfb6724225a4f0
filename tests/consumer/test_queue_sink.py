"""QueueSink: the bounded hand-over between the receive threads and an iterable facade's consumer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from stoker.consumer.receive.contract import SinkClosed
from stoker.consumer.receive.queue_sink import END, QueueSink


def _batch(value: int) -> list[np.ndarray]:
    return [np.full(4, value, np.int64)]


def _until(condition, what: str, limit: float = 30.0) -> None:
    """Wait for a state (not for a time): fails only if it never comes."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


def test_put_now_takes_a_batch_only_with_room_and_counts_it_before_it_can_be_taken():
    sink = QueueSink(2)
    seen_before = []

    def before() -> None:
        seen_before.append(sink._items.qsize())  # counted first: the batch is not there to take yet

    assert sink.put_now(_batch(1), True, before) and sink.put_now(_batch(2), True, before)
    assert seen_before == [0, 1] and sink.size() == 2
    assert not sink.put_now(_batch(3), True, lambda: pytest.fail("counted a batch that found no room"))
    assert [int(sink.take(0)[0][0]) for _ in range(2)] == [1, 2]
    assert sink.take(0) is None and sink.size() == 0


def test_a_put_waiting_for_room_is_not_overtaken_and_close_ends_it():
    sink = QueueSink(1)
    sink.put(_batch(1), True)
    outcome: list = []
    waiter = threading.Thread(target=lambda: outcome.append(sink.put(_batch(2), True)))
    waiter.start()
    _until(lambda: sink._waiting == 1, "the second put waits for room")
    assert int(sink.take(0)[0][0]) == 1
    assert not sink.put_now(_batch(3), True, lambda: None)  # the room is the waiting put's, taken or not yet
    waiter.join(30)
    assert outcome == [None] and int(sink.take(5)[0][0]) == 2
    sink.put(_batch(4), True)
    closing = threading.Thread(target=lambda: outcome.append(pytest.raises(SinkClosed, sink.put, _batch(5), True)))
    closing.start()
    _until(lambda: sink._waiting == 1, "a put waits on a full sink")
    sink.close(cancel=True)
    closing.join(30)
    assert not closing.is_alive() and len(outcome) == 2
    with pytest.raises(SinkClosed):
        sink.put_now(_batch(6), True, lambda: None)
    assert int(sink.take(0)[0][0]) == 4  # what was in it is still taken after close


def test_the_end_marker_follows_every_batch_and_takes_no_room():
    sink = QueueSink(1)
    sink.put(_batch(1), True)
    sink.end()
    assert sink.size() == 1
    assert int(sink.take(0)[0][0]) == 1 and sink.take(0) is END and sink.take(0) is None


def test_puts_from_many_threads_never_hold_more_than_the_capacity():
    sink, capacity, per_thread = QueueSink(3), 3, 300
    most = [0]

    def producer(start: int) -> None:
        for i in range(per_thread):
            if not sink.put_now(_batch(start + i), True, lambda: None):
                sink.put(_batch(start + i), True)

    threads = [threading.Thread(target=producer, args=(k * per_thread,)) for k in range(4)]
    for t in threads:
        t.start()
    taken = []
    while len(taken) < 4 * per_thread:
        most[0] = max(most[0], sink.size())
        item = sink.take(5)
        assert item is not None, "a batch was lost"
        taken.append(int(item[0][0]))
    for t in threads:
        t.join(30)
    assert most[0] <= capacity and sorted(taken) == list(range(4 * per_thread)) and sink.size() == 0
