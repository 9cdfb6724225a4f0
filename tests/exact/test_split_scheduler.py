"""An elastic pool's logic without sockets: the trainer's SplitScheduler and the producer's PoolPolicy together.

A small simulation drives both ends as the transport would (work messages in, batches out), with
producers joining, dying with batches in flight, and coming back as stragglers; every record of every
epoch must reach the steps exactly once.
"""

from __future__ import annotations

import random
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.pool.split_plan import MIN_SPLITS, split_records
from stoker.consumer.exact.pool.split_scheduler import SplitScheduler
from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import (Credit, Hello, Work, WorkItem, decode_trainer_message, encode_work)
from stoker.protocol.input_state import InputState, StreamKey, epoch_order
from stoker.producer.serve.policies.pool import PoolPolicy

KEY = StreamKey.parse("splits:103:7")


def _completes(state, key):
    """What a scheduler reports complete, written as the trainer writes it: by its ledger, the state's one writer."""
    return partial(ConsumedLedger("trainer", state).complete_pool_epoch, str(key))


def _scheduler(epochs=2, split=10, rank=0, world=1, state=None, key=KEY):
    state = state or InputState()
    return SplitScheduler(key, state.progress(str(key)), _completes(state, key), epochs, split, rank, world), state


def _server(trainer=b"t", session=1, credit=1000, epochs=2):
    server = PoolPolicy(KEY, "p", epochs)
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
    server.trainers.drop(b"t")
    assert server.gone(chunk)


def test_a_trainer_cannot_make_a_producer_hold_or_compute_without_bound():
    server = _server()
    with pytest.raises(ProtocolError, match="epochs"):
        server.on_work(b"t", Work(1, [WorkItem(e, 0, 10, []) for e in range(3)]))
    big = PoolPolicy(StreamKey.parse("splits:1000000:0"), "p")
    big.on_hello(b"t", Hello("trainer", 1, 10, InputState()))
    items = [WorkItem(0, s, s + 65536, []) for s in range(0, 65536 * 5, 65536)]
    with pytest.raises(ProtocolError, match="queue"):
        big.on_work(b"t", Work(1, items))


def test_a_finite_producer_finishes_when_its_trainers_did_or_are_gone():
    server = _server(epochs=1)
    server.on_hello(b"u", Hello("other", 1, 10, InputState()))
    server.on_work(b"t", Work(1, [], finished=True))
    assert not server.finished  # "other" still trains
    server.trainers.drop(b"u")  # it died: not waited for
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


def _simulate(seed: int, world: int = 1, key: StreamKey = KEY) -> None:
    """Producers join, die with what they held, straggle; every record of the share arrives once per epoch."""
    rng = random.Random(seed)
    trainers = [_scheduler(epochs=3, split=7, rank=r, world=world, key=key) for r in range(world)]
    consumed = [dict() for _ in range(world)]  # epoch -> list of records stepped on
    servers: dict[int, PoolPolicy] = {}
    dead_batches: list = []
    next_id = 0
    for step in range(20000):
        if all(s.finished for s, _ in trainers):
            break
        roll = rng.random()
        if roll < 0.03 or not servers:  # a producer joins
            servers[next_id] = PoolPolicy(key, f"p{next_id}", 3)
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
        order2 = sched.key.order_version == 2  # kept as epoch positions
        sched.progress.mark(e, sched.key.lazy_order().positions(e, indices[epochs == e]) if order2
                            else indices[epochs == e])
    sched.consumed(epochs, indices)


@pytest.mark.parametrize("seed", range(6))
def test_every_record_once_per_epoch_through_joins_deaths_and_stragglers(seed):
    _simulate(seed)


@pytest.mark.parametrize("seed", range(3))
def test_two_trainers_take_disjoint_shares_and_together_every_record(seed):
    _simulate(seed, world=2)


@pytest.mark.parametrize("key", ["splits:103:7:o2", "splits:103:7:10x1:o2", "splits:103:7:9x4:o2"])
@pytest.mark.parametrize("seed,world", [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_every_record_once_per_epoch_in_epoch_order_2(seed, world, key):
    """The same simulation over a lazily ordered pool, whose epochs the scheduler keeps as ranges of positions."""
    _simulate(seed, world, StreamKey.parse(key))


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


def test_a_restored_state_in_epoch_order_2_is_not_asked_for_again():
    key = StreamKey.parse("splits:103:7:10x2:o2")
    sched, state = _scheduler(epochs=1, key=key)
    items = sched.top_up(0)
    first = key.lazy_order().records(0, items[0].start, items[0].end)
    sched.arrived(np.zeros(len(first)), first, np.ones(len(first), bool))
    state.mark(str(key), np.zeros(4, np.int64), first[:4])
    restored, _ = _scheduler(epochs=1, state=InputState.from_bytes(state.to_bytes()), key=key)
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
    server = PoolPolicy(KEY, "p", 2, make_ahead=2)
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


# ---- liveness: every producer gets work, a stuck one's work goes to the others, stragglers are backed up ----

def test_splits_are_small_enough_for_every_producer_of_a_growing_pool_and_whole_batches():
    assert split_records(1024, 32) == 32  # the demo: 32 splits an epoch, not the 2 of 16-batch splits
    assert split_records(1_000_000, 64) == 16 * 64  # large datasets keep 16-batch splits
    assert split_records(20_000, 64) == 4 * 64  # 20,000 records / 64 splits = 312 records: 4 whole batches
    assert split_records(100, 64) == 64  # a batch at least
    assert split_records(1_000_000, 64, world=8) == 16 * 64 and split_records(100_000, 64, world=8) == 64 * 3
    for records, batch, world in [(1024, 32, 1), (1024, 8, 2), (50_000, 64, 4), (3000, 8, 1)]:
        split = split_records(records, batch, world)
        assert split % batch == 0
        assert -(-records // split) >= min(MIN_SPLITS * world, records // batch)


def _pool(records=1024, batch=32, epochs=2, stall_after=5.0):
    key = StreamKey.parse(f"splits:{records}:7")
    state = InputState()
    sched = SplitScheduler(key, state.progress(str(key)), _completes(state, key), epochs,
                           split_records(records, batch),
                           stall_after=stall_after)
    return sched, key


def _serve(sched, key, item, producer, now, n=None):
    """Producer ``producer`` delivers the first ``n`` records (all: None) of a work item at ``now``; rows kept."""
    order = epoch_order(np.arange(key.records), key.seed, item.epoch)[item.start:item.end]
    skip = set(item.skip)
    records = np.asarray([r for k, r in enumerate(order) if k not in skip][:n], np.int64)
    return sched.arrived(np.full(len(records), item.epoch), records, np.ones(len(records), bool), producer, now)


def test_a_producer_joining_a_pool_of_two_takes_work_at_once_on_a_small_dataset():
    sched, _ = _pool()
    for p in (0, 1):
        assert len(sched.top_up(p, now=0.0)) == 2
    assert len(sched.top_up(2, now=1.0)) == 2  # the newcomer: free splits are there


def test_a_stuck_producers_splits_go_to_the_others_and_it_gets_work_again_once_it_serves():
    sched, key = _pool(stall_after=5.0)
    stuck_items = sched.top_up(0, now=0.0)
    other_items = sched.top_up(1, now=0.0)
    for item in other_items:
        assert _serve(sched, key, item, 1, now=1.0).all()
    assert sched.stalls(now=4.0) == []  # within the bound
    found = sched.stalls(now=6.0)
    assert [p for p, _, _ in found] == [0] and found[0][2] == 2 * sched.split
    assert sched.reserved == 2 and sched.top_up(0, now=6.0) == []  # stuck: no new work
    again = sched.top_up(1, now=6.0)
    assert [(i.epoch, i.start) for i in again] == [(i.epoch, i.start) for i in stuck_items]  # re-served first
    for item in again:
        assert _serve(sched, key, item, 1, now=7.0).all()
    # The stuck producer wakes up and sends what it made: nothing of it is kept, it counts as wasted work, and it
    # is responsive again: it takes new work.
    assert not _serve(sched, key, stuck_items[0], 0, now=8.0).any()
    assert sched.duplicates == sched.split and 0 not in sched.stuck
    assert sched.top_up(0, now=8.0)


def test_nobody_is_taken_for_stuck_while_the_trainers_queue_is_full_or_alone_in_the_pool():
    sched, key = _pool(stall_after=5.0)
    sched.top_up(0, now=0.0)
    assert sched.stalls(now=60.0) == []  # alone: nobody could take its work
    items = sched.top_up(1, now=0.0)
    _serve(sched, key, items[0], 1, now=1.0)
    sched.queue_full(now=58.0)  # the step is slow: producers wait for credit
    assert sched.stalls(now=60.0) == []
    assert [p for p, _, _ in sched.stalls(now=64.0)] == [0]
    # A full queue does not excuse a producer that the others outpaced by more than the bound: it is not credit.
    sched, key = _pool(stall_after=5.0)
    sched.top_up(0, now=0.0)
    items = sched.top_up(1, now=5.5)
    _serve(sched, key, items[0], 1, now=6.0)  # a split in 0.5 s: the bound stays the 5 s floor
    sched.queue_full(now=6.5)
    assert [p for p, _, _ in sched.stalls(now=7.0)] == [0]


def test_an_idle_producer_backs_up_a_stragglers_split_and_not_a_healthy_one():
    def race(slow_pace: float) -> int:
        sched, key = _pool(records=256, batch=8, epochs=1, stall_after=1000.0)  # 32 splits of 8 in one epoch
        held = {0: sched.top_up(0, now=0.0), 1: sched.top_up(1, now=0.0)}
        now = {0: 0.0, 1: 0.0}
        pace = {0: slow_pace, 1: 1.0}  # seconds per split
        backups = 0
        while not sched.finished:
            p = min(now, key=now.get)  # the producer whose next split is done first
            if not held[p]:
                more = sched.top_up(p, now=now[p])
                if not more:
                    now[p] = min(now.values()) + 0.5 if len(set(now.values())) > 1 else now[p] + 0.5
                    if all(not h for h in held.values()) and not more:
                        break
                    continue
                held[p] = more
            item = held[p].pop(0)
            now[p] += pace[p]
            keep = _serve(sched, key, item, p, now=now[p])
            epochs = np.zeros(int(keep.sum()), np.int64)
            order = epoch_order(np.arange(key.records), key.seed, 0)[item.start:item.end]
            rows = np.asarray([r for k, r in enumerate(order) if k not in set(item.skip)], np.int64)[keep]
            sched.progress.mark(0, rows)
            sched.consumed(epochs, rows)
            held[p] += sched.top_up(p, now=now[p])
            backups = sched.backups
        assert sched.finished
        return backups

    assert race(1.0) == 0  # equal paces: nothing is worth doing twice
    assert race(4.0) > 0  # a producer at a quarter speed: its last splits are backed up by the idle one


@pytest.mark.parametrize("text", ["splits:300:5", "splits:300:5:20x1:o2"])
def test_every_record_once_per_epoch_while_producers_freeze_thaw_and_straggle(text):
    """Virtual time: producers of different speeds, some frozen for a while, one for good; the stall bound hands
    their work on, idle producers back up stragglers, and every record still comes once per epoch."""
    reserved = backups = 0
    for seed in range(4):
        rng = random.Random(seed)
        key = StreamKey.parse(text)
        state = InputState()
        sched = SplitScheduler(key, state.progress(str(key)), _completes(state, key), 3, 10, stall_after=3.0)
        servers = {p: PoolPolicy(key, f"p{p}", 3) for p in range(3)}
        for server in servers.values():
            server.on_hello(b"t", Hello("t", 1, 10**6, InputState()))
        speed = {0: 1, 1: 1, 2: 4}  # ticks per batch: one straggler
        frozen_until = {p: 0.0 for p in servers}
        servers[3] = PoolPolicy(key, "p3", 3)
        servers[3].on_hello(b"t", Hello("t", 1, 10**6, InputState()))
        speed[3], frozen_until[3] = 1, float("inf")  # takes work, never serves
        consumed: dict[int, list[int]] = {}
        now = 0.0
        for tick in range(20000):
            if sched.finished:
                break
            now = tick * 0.1
            if rng.random() < 0.002:
                frozen_until[rng.choice(list(servers))] = now + rng.uniform(2, 20)
            sched.stalls(now)
            for p, server in servers.items():
                items = sched.top_up(p, now)
                if items:
                    server.on_work(b"t", Work(1, items))
                if now < frozen_until[p] or tick % speed[p]:
                    continue
                chunk = server.next_chunk(5)
                if chunk is None:
                    continue
                server.on_sent(b"t", chunk.epochs, chunk.indices, chunk)
                keep = sched.arrived(np.asarray(chunk.epochs), np.asarray(chunk.indices), np.ones(len(chunk), bool),
                                     p, now)
                _step(sched, consumed, chunk, keep)
        assert sched.finished, f"seed {seed}: the run did not finish"
        for epoch in range(3):
            assert sorted(consumed[epoch]) == list(range(300)), f"seed {seed}, epoch {epoch}"
        assert 3 in sched.stuck
        reserved, backups = reserved + sched.reserved, backups + sched.backups
    assert reserved > 0 and backups > 0


def test_a_producer_of_another_pool_is_refused_saying_endless_not_none_epochs(caplog):
    from stoker.consumer.exact.pool.pool_work import PoolWork
    from stoker.consumer.exact.producers import KnownProducer
    from stoker.protocol.exact_messages import Status
    import logging
    import threading

    scheduler, _ = _scheduler(epochs=None)
    producers = [KnownProducer("tcp://127.0.0.1:1", None, 0.0)]
    work = PoolWork(scheduler, None, producers, threading.Lock(), lambda i, frame: True, lambda i: None)
    with caplog.at_level(logging.ERROR, logger="stoker.consumer"):
        work.join(0, Status("splits:103:8", "p-other-seed", 0, 2, False, session=1))
    assert work.pooled() == [] and not producers[0].pooled
    assert "serves splits:103:8 (2 epochs) but this trainer's pool is splits:103:7 (endless)" in caplog.text
    assert "None" not in caplog.text


def test_a_restored_order_2_epoch_hands_out_work_past_its_consumed_prefix_without_asking_each_split(monkeypatch):
    """A 10^10-record pool restored with its first 10^9 positions consumed (about 244,000 splits): the first
    top_up skips the prefix in one step. Asking each split in turn cost ~60 us a split, a minute and more."""
    from stoker.consumer.exact.pool.range_split_epoch import RangeSplitEpoch
    from stoker.protocol.epochs.position_ranges import PositionRanges

    key = StreamKey.parse("splits:10000000000:7:10000x1:o2")
    state = InputState()
    progress = state.progress(str(key))
    progress.open[0] = PositionRanges.from_ranges(np.array([0]), np.array([10**9]), 10**10)
    asked = []
    original = RangeSplitEpoch.unfinished
    monkeypatch.setattr(RangeSplitEpoch, "unfinished", lambda self, s: asked.append(s) or original(self, s))
    sched = SplitScheduler(key, progress, _completes(state, key), 1, 4096)
    items = sched.top_up(0)
    assert items and all(item.start >= 10**9 - 4096 for item in items)
    assert len(asked) < 100
