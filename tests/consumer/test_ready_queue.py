"""ReadyQueue: the one wake-up pipe and ready queue every direct exact link of an input shares (issue 41)."""

import select

from hypothesis import given, settings, strategies as st

from stoker.consumer.transport.ready_queue import ReadyQueue


def _readable(queue: ReadyQueue) -> bool:
    return bool(select.select([queue.pollable], [], [], 0)[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ready", "drained", "take"]), st.integers(0, 5), st.integers(1, 4)),
                max_size=60))
def test_the_pipe_is_readable_exactly_while_a_key_is_queued_and_take_goes_round(ops):
    queue, model = ReadyQueue(), []  # the model: keys queued, in turn order
    try:
        for op, key, most in ops:
            if op == "ready":
                queue.ready(key)
                if key not in model:
                    model.append(key)
            elif op == "drained":
                queue.drained(key)
                if key in model:
                    model.remove(key)
            else:
                taken = queue.take(most)
                assert taken == model[:most]  # the oldest first, at most ``most``
                model = model[len(taken):] + taken  # each taken key waits behind the others
            assert _readable(queue) == bool(model) and len(queue) == len(model)
    finally:
        queue.close()


def test_a_reader_with_room_for_one_reads_every_ready_key_in_turn():
    queue = ReadyQueue()
    try:
        for key in range(4):
            queue.ready(key)
        assert [queue.take(1)[0] for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
        assert queue.take() == [0, 1, 2, 3]
    finally:
        queue.close()


def test_a_closed_queue_takes_no_key_and_its_pipe_is_closed():
    queue = ReadyQueue()
    queue.ready("a")
    queue.close()
    queue.ready("b")  # a loop thread still running after the input closed: ignored, never a write to a closed pipe
    queue.drained("a")
    assert queue.take() == [] and len(queue) == 0
