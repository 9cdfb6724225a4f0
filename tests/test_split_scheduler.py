"""An elastic pool's logic without sockets: the trainer's SplitScheduler and the producer's SplitServer together.

A small simulation drives both ends as the transport would (work messages in, batches out), with
producers joining, dying with batches in flight, and coming back as stragglers; every record of every
epoch must reach the steps exactly once.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.consumer.split_scheduler import SplitScheduler
from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import (Credit, Hello, Work, WorkItem, decode_trainer_message, encode_work)
from stoker.protocol.input_state import InputState, StreamKey, epoch_order
from stoker.producer.split_server import SplitServer

KEY = StreamKey.parse("splits:103:7")


def _scheduler(epochs=2, split=10, rank=0, world=1, state=None):
    state = state or InputState()
    return SplitScheduler(KEY, state.progress(str(KEY)), epochs, split, rank, world), state


def _server(trainer=b"t", session=1, credit=1000, epochs=2):
    server = SplitServer(KEY, "p", epochs)
    server.on_hello(trainer, Hello("trainer", session, credit, InputState()))
    return server


def test_the_stream_key_of_a_pool_round_trips_and_is_the_whole_dataset():
    assert str(KEY) == "splits:103:7" and KEY.splits and KEY.size == 103
    assert np.array_equal(KEY.local(np.arange(103)), np.arange(103))
    with pytest.raises(ValueError):
        StreamKey.parse("splits:x:7")


def test_work_messages_round_trip_and_bad_ones_are_refused_by_name():
    work = Work(3, [WorkItem(1, 10, 20, [0, 9])], finished=False)
    assert decode_trainer_message(encode_work(work)) == work
    import msgpack
    for bad, why in [({"t": "work", "session": 1, "items": [[0, 5, 5, []]]}, "end"),
                     ({"t": "work", "session": 1, "items": [[0, 0, 10, [10]]]}, "skip offset"),
                     ({"t": "work", "session": 1, "items": [[0, 0, 1 << 17, []]]}, "end"),
                     ({"t": "work", "session": 1, "items": [[0, 0, 2, [0, 1, 1]]]}, "more offsets"),
                     ({"t": "work", "session": 1, "items": "x"}, "items"),
                     ({"t": "work", "session": 1, "items": [], "finished": 1}, "finished")]:
        with pytest.raises(ProtocolError, match=why):
            decode_trainer_message(msgpack.packb(bad))


def test_a_split_outside_the_producers_dataset_is_refused():
    server = _server()
    with pytest.raises(ProtocolError, match="same dataset"):
        server.on_work(b"t", Work(1, [WorkItem(0, 100, 110, [])]))


def test_the_producer_serves_exactly_the_split_less_its_skips_in_the_epochs_order():
    server = _server()
    assert server.on_work(b"t", Work(1, [WorkItem(1, 10, 20, [0, 5])]))
    assert not server.on_work(b"t", Work(2, [WorkItem(1, 0, 5, [])]))  # another session: ignored
    chunk = server.next_chunk(100)
    order = epoch_order(np.arange(103), 7, 1)[10:20]
    assert chunk.indices == [int(i) for k, i in enumerate(order) if k not in (0, 5)] and set(chunk.epochs) == {1}
    assert chunk.trainer == b"t" and server.route(chunk) == b"t"


def test_a_batch_made_for_a_trainer_that_restarted_or_left_is_not_sent():
    server = _server()
    server.on_work(b"t", Work(1, [WorkItem(0, 0, 16, [])]))
    chunk = server.next_chunk(8)
    assert not server.gone(chunk)
    server.on_hello(b"t", Hello("trainer", 2, 10, InputState()))  # restarted: hands out its splits afresh
    assert server.gone(chunk)
    assert server.next_chunk(8) is None  # the old session's work is gone
    server.drop(b"t")
    assert server.gone(chunk)


def test_a_trainer_cannot_make_a_producer_hold_or_compute_without_bound():
    server = _server()
    with pytest.raises(ProtocolError, match="epochs"):
        server.on_work(b"t", Work(1, [WorkItem(e, 0, 10, []) for e in range(3)]))
    big = SplitServer(StreamKey.parse("splits:1000000:0"), "p")
    big.on_hello(b"t", Hello("trainer", 1, 10, InputState()))
    items = [WorkItem(0, s, s + 65536, []) for s in range(0, 65536 * 5, 65536)]
    with pytest.raises(ProtocolError, match="queue"):
        big.on_work(b"t", Work(1, items))


def test_a_finite_producer_finishes_when_its_trainers_did_or_are_gone():
    server = _server(epochs=1)
    server.on_hello(b"u", Hello("other", 1, 10, InputState()))
    server.on_work(b"t", Work(1, [], finished=True))
    assert not server.finished  # "other" still trains
    server.drop(b"u")  # it died: not waited for
    assert server.finished
    server.on_hello(b"t", Hello("trainer", 2, 10, InputState()))  # back, with its run to do again
    assert not server.finished


def test_the_scheduler_hands_out_the_oldest_epoch_first_and_at_most_one_epoch_ahead():
    sched, _ = _scheduler(epochs=5)
    items = []
    for producer in range(30):
        items += sched.top_up(producer)
    assert {i.epoch for i in items} == {0, 1}  # 11 splits per epoch, 2 epochs open
    assert [i.epoch for i in items] == sorted(i.epoch for i in items)
    assert sum(i.end - i.start for i in items) == 2 * 103


def _simulate(seed: int, world: int = 1) -> None:
    """Producers join, die with what they held, straggle; every record of the share arrives once per epoch."""
    rng = random.Random(seed)
    trainers = [_scheduler(epochs=3, split=7, rank=r, world=world) for r in range(world)]
    consumed = [dict() for _ in range(world)]  # epoch -> list of records stepped on
    servers: dict[int, SplitServer] = {}
    dead_batches: list = []
    next_id = 0
    for step in range(20000):
        if all(s.finished for s, _ in trainers):
            break
        roll = rng.random()
        if roll < 0.03 or not servers:  # a producer joins
            servers[next_id] = SplitServer(KEY, f"p{next_id}", 3)
            for r in range(world):
                servers[next_id].on_hello(bytes([r]), Hello(f"t{r}", 1, 1000, InputState()))
            next_id += 1
        elif roll < 0.05 and len(servers) > 1:  # one dies; some of its made batches still arrive later
            victim = rng.choice(list(servers))
            server = servers.pop(victim)
            for r, (sched, _) in enumerate(trainers):
                sched.release(victim)
                chunk = server.next_chunk(5)
                if chunk is not None:
                    dead_batches.append((r, chunk))
        for pid, server in servers.items():
            for r, (sched, _) in enumerate(trainers):
                items = sched.top_up(pid)
                if items:
                    server.on_work(bytes([r]), Work(1, items))
        if dead_batches and rng.random() < 0.3:  # a straggler from a dead producer
            r, chunk = dead_batches.pop(0)
            keep = trainers[r][0].arrived(np.asarray(chunk.epochs), np.asarray(chunk.indices),
                                          np.ones(len(chunk), bool))
            _step(trainers[r][0], consumed[r], chunk, keep)
        if servers:
            pid = rng.choice(list(servers))
            chunk = servers[pid].next_chunk(5)
            if chunk is not None:
                r = chunk.trainer[0]
                servers[pid].on_sent(chunk.trainer, chunk.epochs, chunk.indices, chunk)
                mask = np.ones(len(chunk), bool)
                if rng.random() < 0.02:
                    mask[0] = False  # a record the producer could not make
                keep = trainers[r][0].arrived(np.asarray(chunk.epochs), np.asarray(chunk.indices), mask)
                _step(trainers[r][0], consumed[r], chunk, keep)
    assert all(s.finished for s, _ in trainers), "the run did not finish"
    failed = sum(s.failed for s, _ in trainers)
    for epoch in range(3):
        got = sorted(i for r in range(world) for i in consumed[r].get(epoch, []))
        assert len(got) == len(set(got)), f"epoch {epoch}: a record came twice"
        assert len(got) >= 103 - failed and len(set(got)) == len(got)
    total = sum(len(v) for r in range(world) for v in consumed[r].values())
    assert total + failed == 3 * 103


def _step(sched: SplitScheduler, consumed: dict, chunk, keep: np.ndarray) -> None:
    epochs, indices = np.asarray(chunk.epochs)[keep], np.asarray(chunk.indices)[keep]
    for e, i in zip(epochs.tolist(), indices.tolist()):
        consumed.setdefault(e, []).append(i)
    for e in set(epochs.tolist()):
        sched.progress.mark(e, indices[epochs == e])
    sched.consumed(epochs, indices)


@pytest.mark.parametrize("seed", range(6))
def test_every_record_once_per_epoch_through_joins_deaths_and_stragglers(seed):
    _simulate(seed)


@pytest.mark.parametrize("seed", range(3))
def test_two_trainers_take_disjoint_shares_and_together_every_record(seed):
    _simulate(seed, world=2)


def test_a_restored_state_is_not_asked_for_again():
    sched, state = _scheduler(epochs=1)
    items = sched.top_up(0)
    order = epoch_order(np.arange(103), 7, 0)
    first = order[items[0].start:items[0].end]
    sched.arrived(np.zeros(len(first)), first, np.ones(len(first), bool))
    state.progress(str(KEY)).mark(0, first[:4])
    restored, _ = _scheduler(epochs=1, state=state.copy())
    again = restored.top_up(0)
    assert again[0].start == items[0].start and again[0].skip == [0, 1, 2, 3]


def test_released_splits_go_to_the_others_less_what_arrived():
    sched, _ = _scheduler(epochs=1)
    items = sched.top_up(0)
    order = epoch_order(np.arange(103), 7, 0)
    got = order[items[0].start:items[0].start + 3]
    assert sched.arrived(np.zeros(3), got, np.ones(3, bool)).all()
    assert sched.release(0) == 2
    handed = sched.top_up(1)
    assert handed[0].start == items[0].start and handed[0].skip == [0, 1, 2]
    assert not sched.arrived(np.zeros(3), got, np.ones(3, bool)).any() and sched.duplicates == 3


_values = st.recursive(st.one_of(st.integers(-(2**40), 2**40), st.booleans(), st.none(), st.text(max_size=6),
                                 st.binary(max_size=8)),
                       lambda inner: st.lists(inner, max_size=5), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["t", "session", "items", "finished", "v", "n", "consumed"]), _values,
                       max_size=5), st.sampled_from(["work", "credit", "hello", "describe", None]))
def test_random_trainer_messages_are_refused_by_name_or_served_within_the_dataset(body, kind):
    """A producer's parser of trainer messages: anything raises ProtocolError or yields a message that the
    split server either refuses or turns into records of its own dataset only."""
    import msgpack

    if kind is not None:
        body = {**body, "t": kind}
    server = _server()
    try:
        message = decode_trainer_message(msgpack.packb(body))
    except ProtocolError:
        return
    if isinstance(message, Work):
        try:
            server.on_work(b"t", Work(1, message.items, message.finished))
        except ProtocolError:
            return
        while (chunk := server.next_chunk(64)) is not None:
            assert all(0 <= i < KEY.records for i in chunk.indices)
            server.on_sent(b"t", chunk.epochs, chunk.indices, chunk)


_ints = st.integers(-5, 2**17)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 4), _ints, _ints, st.lists(_ints, max_size=6)), max_size=8))
def test_random_work_items_are_refused_or_serve_only_their_own_records(items):
    import msgpack

    server = _server(epochs=3)
    try:
        work = decode_trainer_message(msgpack.packb({"t": "work", "session": 1,
                                                     "items": [[e, s, t, list(k)] for e, s, t, k in items]}))
        server.on_work(b"t", work)
    except ProtocolError:
        return
    served = []
    while (chunk := server.next_chunk(64)) is not None:
        served += list(zip(chunk.epochs, chunk.indices))
        server.on_sent(b"t", chunk.epochs, chunk.indices, chunk)
    expected = []
    for item in work.items:
        order = epoch_order(np.arange(103), 7, item.epoch)[item.start:item.end]
        expected += [(item.epoch, int(r)) for k, r in enumerate(order) if k not in set(item.skip)]
    assert served == expected


def test_a_trainer_whose_share_would_be_empty_is_refused_by_name():
    # 103 records in splits of 128: one split, rank 0's; rank 1 of 2 would never get a record.
    with pytest.raises(ValueError, match="share 1/2 of an elastic pool is empty"):
        _scheduler(epochs=3, split=128, rank=1, world=2)


def test_an_epoch_a_restored_state_completed_is_skipped_and_the_window_moves_on():
    state = InputState()
    state.progress(str(KEY)).consumed(0)[:] = True  # epoch 0 all consumed, not yet closed
    sched, _ = _scheduler(epochs=3, split=10, state=state)
    assert sched.progress.completed == 1 and sorted(sched.open) == [1, 2]


def test_credit_and_a_few_batches_ahead_bound_what_is_made_for_a_trainer():
    """Credit comes back in steps of half the trainer's window: workers gated by credit alone would idle between."""
    server = SplitServer(KEY, "p", 2, make_ahead=2)
    server.on_hello(b"t", Hello("trainer", 1, 1, InputState()))  # credit for one batch
    server.on_work(b"t", Work(1, [WorkItem(0, 0, 50, [])]))
    chunks = [server.next_chunk(5) for _ in range(4)]
    assert all(c is not None for c in chunks[:3]) and chunks[3] is None  # credit 1 + 2 ahead, no more
    assert server.route(chunks[0]) == b"t"
    server.on_sent(b"t", chunks[0].epochs, chunks[0].indices, chunks[0])
    assert server.route(chunks[1]) is None  # made, waiting in its slot for credit
    server.on_credit(b"t", Credit(1, 1))
    assert server.route(chunks[1]) == b"t"
    server.on_sent(b"t", chunks[1].epochs, chunks[1].indices, chunks[1])
    assert server.next_chunk(5) is not None and server.next_chunk(5) is None  # one more sent: room for one more
