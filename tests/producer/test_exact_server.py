"""The exact-mode serving logic on its own: no sockets, no processes, every decision checked."""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest
import numpy as np

from stoker.producer.serve.policies.fixed_shards import FixedShardPolicy
from stoker.protocol.exact_messages import Credit, Hello, decode_status, encode_status
from stoker.protocol.input_state import InputState, StreamKey

KEY = StreamKey(1, 2, 41, seed=5)  # records 1, 3, ..., 39: 20 of them
RECORDS = list(range(1, 41, 2))


def _hello(trainer="t", session=1, credit=100, state=None, held=None) -> Hello:
    return Hello(trainer, session, credit, state or InputState(), held or {})


def _serve(server, routing=b"a", n=6, limit=100):
    """Chunks sent to ``routing`` until nothing more is served: [(epochs, indices)]."""
    sent = []
    for _ in range(limit):
        chunk = server.next_chunk(n)
        if chunk is None:
            return sent
        server.on_sent(routing, chunk.epochs, chunk.indices)
        sent.append((chunk.epochs, chunk.indices))
    raise AssertionError("never stopped serving")


def _consume(server, routing, batches, session=1, now=None):
    for epochs, indices in batches:
        server.on_credit(routing, Credit(session, 1, [(e, [i for ee, i in zip(epochs, indices) if ee == e])
                                                      for e in sorted(set(epochs))]), now=now)


def test_one_epoch_is_served_once_in_its_order_and_the_run_finishes():
    server = FixedShardPolicy(KEY, "p", epochs=1)
    assert server.next_chunk(6) is None  # nothing before a trainer says hello
    server.on_hello(b"a", _hello())
    sent = _serve(server)
    assert [len(i) for _, i in sent] == [6, 6, 6, 2]  # the last batch partial
    served = [i for _, indices in sent for i in indices]
    assert sorted(served) == RECORDS and len(served) == len(set(served))
    assert not server.finished
    _consume(server, b"a", sent)
    assert server.finished and server.completed == 1 and server.status().finished


def test_the_next_epoch_opens_without_waiting_for_the_last_to_be_consumed():
    server = FixedShardPolicy(KEY, "p")
    server.on_hello(b"a", _hello())
    first = [server.next_chunk(10) for _ in range(3)]
    assert [set(c.epochs) for c in first] == [{0}, {0}, {1}]


def test_a_dead_trainers_records_go_to_the_survivor_and_nothing_is_served_twice_to_the_living():
    server = FixedShardPolicy(KEY, "p", epochs=1, trainer_timeout=5)
    server.on_hello(b"a", _hello("A"), now=0)
    server.on_hello(b"b", _hello("B"), now=0)
    to_a = [server.next_chunk(5) for _ in range(2)]
    to_b = [server.next_chunk(5) for _ in range(2)]
    for c in to_a:
        server.on_sent(b"a", c.epochs, c.indices)
    for c in to_b:
        server.on_sent(b"b", c.epochs, c.indices)
    _consume(server, b"a", [(to_a[0].epochs, to_a[0].indices)], now=1)  # A consumed one batch, then died
    server.on_credit(b"b", Credit(1, 0, []), now=7)  # B stays alive; A has been silent for more than 5 s
    assert server.trainers.expire(now=7) == ["A"]
    again = _serve(server, b"b")
    assert sorted(i for _, idx in again for i in idx) == sorted(to_a[1].indices)
    _consume(server, b"b", [(c.epochs, c.indices) for c in to_b] + again)
    assert server.finished and server.reserved_total == 5


def test_a_trainer_restarted_from_an_older_state_gets_what_it_consumed_since():
    server = FixedShardPolicy(KEY, "p", epochs=1)
    server.on_hello(b"a", _hello("T"))
    sent = _serve(server)
    checkpoint = InputState()
    checkpoint.mark(str(KEY), sent[0][0], sent[0][1])  # saved after the first batch
    _consume(server, b"a", sent[:3])  # then consumed two more and died
    server.on_hello(b"a2", _hello("T", session=1, state=checkpoint))  # restarted from the checkpoint
    again = _serve(server, b"a2")
    served_again = Counter(i for _, idx in again for i in idx)
    assert set(served_again) == set(RECORDS) - set(sent[0][1]) and set(served_again.values()) == {1}


def test_a_restarted_producer_resumes_the_epoch_without_what_is_consumed_or_held():
    first = FixedShardPolicy(KEY, "p")
    first.on_hello(b"a", _hello())
    sent = []
    for _ in range(3):  # sent 3 batches, then the producer died
        chunk = first.next_chunk(6)
        first.on_sent(b"a", chunk.epochs, chunk.indices)
        sent.append((chunk.epochs, chunk.indices))
    state = InputState()
    state.mark(str(KEY), sent[0][0], sent[0][1])
    held = {str(KEY): [(0, sent[1][1])]}  # the trainer still has batch 1 queued; batch 2 was lost in transit
    second = FixedShardPolicy(KEY, "p")
    second.on_hello(b"a", _hello(session=2, state=state, held=held))
    rest = sorted(set(RECORDS) - set(sent[0][1]) - set(sent[1][1]))
    chunk = second.next_chunk(len(rest))
    assert set(chunk.epochs) == {0} and sorted(chunk.indices) == rest


def test_skipped_records_count_as_done_and_a_worker_that_died_returns_its_chunk():
    server = FixedShardPolicy(KEY, "p", epochs=1)
    server.on_hello(b"a", _hello())
    lost_with_worker = server.next_chunk(5)
    server.on_unsent(lost_with_worker)
    sent = _serve(server)
    served = sorted(i for _, idx in sent for i in idx)
    assert served == RECORDS  # the dead worker's chunk was handed out again
    bad = sent[0][1][0]
    server.on_skipped([0], [bad])
    good = [i for i in served if i != bad]
    _consume(server, b"a", [([0] * len(good), good)])
    assert server.finished and server.skipped_total == 1


def test_credit_is_needed_to_send_and_old_sessions_are_ignored():
    server = FixedShardPolicy(KEY, "p")
    server.on_hello(b"a", _hello(credit=1))
    assert server.route(None) == b"a"
    chunk = server.next_chunk(4)
    server.on_sent(b"a", chunk.epochs, chunk.indices)
    assert server.route(None) is None  # no credit left
    assert not server.on_credit(b"a", Credit(0, 3, []))  # an old session's credit
    assert server.on_credit(b"a", Credit(1, 1, [])) and server.route(None) == b"a"


def test_nothing_is_served_before_the_minimum_number_of_trainers_joined():
    server = FixedShardPolicy(KEY, "p", min_trainers=2)
    assert server.status().waiting == 2
    server.on_hello(b"a", _hello("A"))
    assert server.next_chunk(4) is None
    # The status says so, and the trainer that waits reads it (it logs who it waits for).
    assert decode_status(msgpack.unpackb(encode_status(server.status()))).waiting == 1
    addressed = server.status()
    addressed.session = 7  # the forwarder names the session of the trainer a status goes to
    assert decode_status(msgpack.unpackb(encode_status(addressed))).session == 7
    server.on_hello(b"b", _hello("B"))
    assert server.next_chunk(4) is not None and server.status().waiting == 0
    server.trainers.drop(b"b")  # once started, a trainer leaving does not stop the others
    assert server.next_chunk(4) is not None and server.status().waiting == 0


def test_no_producer_serves_more_than_one_epoch_ahead_of_the_oldest_incomplete_one():
    server = FixedShardPolicy(KEY, "p")  # endless run, a 20-record epoch, credit for 100 batches
    server.on_hello(b"a", _hello(credit=100))
    sent = _serve(server, n=8)  # nothing consumed: serving must stop, not run epochs ahead
    assert {e for epochs, _ in sent for e in epochs} == {0, 1}
    assert sorted(i for epochs, indices in sent for e, i in zip(epochs, indices) if e == 1) == RECORDS
    only_epoch_0 = [([e for e in epochs if e == 0], [i for e, i in zip(epochs, indices) if e == 0])
                    for epochs, indices in sent]
    _consume(server, b"a", [batch for batch in only_epoch_0 if batch[1]])
    assert server.completed == 1  # epoch 0 complete: epoch 2 may open now, epoch 3 not yet
    more = _serve(server, n=8)
    assert {e for epochs, _ in more for e in epochs} == {2}


def test_after_a_trainer_restarts_from_a_mid_epoch_state_the_open_epoch_comes_first():
    server = FixedShardPolicy(KEY, "p")
    server.on_hello(b"a", _hello(credit=100))
    sent = _serve(server, n=4)  # epochs 0 and 1 handed out to the first incarnation
    first_half = sent[:2]  # its checkpoint: two batches of epoch 0 consumed
    _consume(server, b"a", first_half)
    state = InputState()
    state.mark(str(KEY), [e for b in first_half for e in b[0]], [i for b in first_half for i in b[1]])
    server.on_hello(b"b", _hello(session=2, state=state))  # restored from that checkpoint
    after = _serve(server, b"b", n=4)
    epochs_in_order = [e for epochs, _ in after for e in epochs]
    open_epoch = [i for epochs, indices in after for e, i in zip(epochs, indices) if e == 0]
    assert sorted(open_epoch) == sorted(set(RECORDS) - {i for b in first_half for i in b[1]})
    assert epochs_in_order == sorted(epochs_in_order)  # the rest of epoch 0 before anything of epoch 1
    assert max(epochs_in_order) <= 1


def test_records_consumed_while_being_made_again_are_found_before_the_batch_is_sent():
    # A trainer consumed a batch but died before reporting it: the records are served again, and a
    # worker is making them into a batch when the trainer's next incarnation says hello with a state
    # in which they are consumed. The forwarder asks before sending; those rows must not go out.
    server = FixedShardPolicy(KEY, "p", epochs=1)
    server.on_hello(b"a", _hello(credit=1))
    chunk = server.next_chunk(6)
    server.on_sent(b"a", chunk.epochs, chunk.indices)
    server.trainers.drop(b"a")  # unreachable: what it held is servable again
    again = server.next_chunk(6)
    assert again.indices == chunk.indices  # lost records come first
    state = InputState()
    state.mark(str(KEY), chunk.epochs[:4], chunk.indices[:4])  # it had consumed four of them
    server.on_hello(b"b", _hello(session=2, state=state))
    stale = server.take_stale(np.array(again.epochs), np.array(again.indices))
    assert stale.tolist() == [True] * 4 + [False] * 2
    server.on_sent(b"b", again.epochs[4:], again.indices[4:])
    rest = _serve(server, b"b")
    served = chunk.indices[:4] + again.indices[4:] + [i for _, indices in rest for i in indices]
    assert sorted(served) == RECORDS  # each record once: none twice, none lost


def test_records_held_again_while_being_made_are_found_before_the_batch_is_sent():
    # The same, but the trainer's next hello says it *holds* three of them (they sat in its queue):
    # they stay its own and must not go out in the batch being made.
    server = FixedShardPolicy(KEY, "p", epochs=1)
    server.on_hello(b"a", _hello(credit=1))
    chunk = server.next_chunk(6)
    server.on_sent(b"a", chunk.epochs, chunk.indices)
    server.trainers.drop(b"a")
    again = server.next_chunk(6)
    server.on_hello(b"b", _hello(session=2, held={str(KEY): [(0, chunk.indices[:3])]}))
    stale = server.take_stale(np.array(again.epochs), np.array(again.indices))
    assert stale.tolist() == [True] * 3 + [False] * 3
    server.on_sent(b"b", again.epochs[3:], again.indices[3:])
    rest = _serve(server, b"b")
    delivered = chunk.indices[:3] + again.indices[3:] + [i for _, indices in rest for i in indices]
    assert sorted(delivered) == RECORDS  # the held three once (already there), the rest once


def test_both_policies_answer_the_forwarders_interface_and_only_a_pools_takes_work():
    from stoker.protocol import ProtocolError
    from stoker.protocol.exact_messages import Work, WorkItem
    from stoker.producer.serve.policies.pool import PoolPolicy

    fixed, pool = FixedShardPolicy(KEY, "p"), PoolPolicy(StreamKey.parse("splits:41:5"), "p")
    work = Work(1, [WorkItem(0, 0, 4, [])])
    with pytest.raises(ProtocolError, match="--shard auto"):
        fixed.on_work(b"t", work)  # a fixed shard takes no work: the forwarder counts it as a bad message
    pool.on_hello(b"t", _hello(credit=4))
    assert pool.on_work(b"t", work) and pool.next_chunk(4).indices  # a pool's does
    for policy in (fixed, pool):
        assert not hasattr(policy, "pick_trainer") and not hasattr(policy, "session_of")
        assert "skipped" in policy.summary()


def test_the_trainer_registry_keeps_one_incarnation_per_trainer_and_forgets_the_silent():
    from stoker.producer.serve.policies.trainer_registry import Trainer, TrainerRegistry

    forgotten = []
    registry = TrainerRegistry(5.0, lambda t: forgotten.append((t.id, t.session)))
    registry.join(Trainer("A", b"a", 1, 2, 0.0))
    registry.join(Trainer("B", b"b", 1, 0, 0.0))
    registry.join(Trainer("A", b"a2", 2, 1, 1.0))  # A reconnected under a new session: the old one is forgotten
    assert forgotten == [("A", 1)] and list(registry) == [b"b", b"a2"]
    assert registry.session_of(b"a2") == 2 and registry.session_of(b"a") == 0  # 0: not joined
    assert registry.on_credit(b"a2", Credit(1, 3, []), now=2.0) is None  # an old session's credit
    assert registry.on_credit(b"b", Credit(1, 1, []), now=4.0).credit == 1
    assert registry.pick() in (b"b", b"a2") and registry.pick(lambda t: t.id == "B") == b"b"
    assert registry.expire(now=6.5) == ["A"] and forgotten[-1] == ("A", 2) and list(registry) == [b"b"]
    assert registry.drop(b"b") == "B" and len(registry) == 0


def test_a_fixed_shard_batch_keeps_its_rows_but_the_stale_and_a_pools_is_void_once_its_trainer_left():
    from stoker.producer.serve.policies.pool import PoolPolicy
    from stoker.protocol.exact_messages import Work, WorkItem

    server = FixedShardPolicy(KEY, "p", epochs=1)
    server.on_hello(b"a", _hello(credit=1))
    chunk = server.next_chunk(6)
    server.on_sent(b"a", chunk.epochs, chunk.indices)
    server.trainers.drop(b"a")
    again = server.next_chunk(6)
    state = InputState()
    state.mark(str(KEY), chunk.epochs[:2], chunk.indices[:2])
    server.on_hello(b"b", _hello(session=2, state=state))
    valid = np.array([True] * 6 + [False, False])  # two rows of padding
    epochs, indices = np.array(again.epochs + [-1, -1]), np.array(again.indices + [-1, -1])
    assert server.wanted(again, epochs, indices, valid).tolist() == [False] * 2 + [True] * 4 + [False] * 2

    pool = PoolPolicy(StreamKey.parse("splits:41:5"), "p")
    pool.on_hello(b"t", _hello(credit=4))
    pool.on_work(b"t", Work(1, [WorkItem(0, 0, 4, [])]))
    made = pool.next_chunk(4)
    rows = np.array(made.indices)
    mask = np.array([True, False, True, True])  # one record failed: its trainer learns it from the batch
    assert pool.wanted(made, np.array(made.epochs), rows, mask).tolist() == [True] * 4
    pool.on_hello(b"t", _hello(session=2))  # restarted: it hands out its splits afresh
    assert pool.route(made) == b"t" and pool.wanted(made, np.array(made.epochs), rows, mask) is None


def test_a_trainer_that_says_goodbye_is_forgotten_at_once_and_its_records_go_to_the_others():
    server = FixedShardPolicy(KEY, "p", epochs=1, trainer_timeout=600)
    server.on_hello(b"a", _hello("A"), now=0)
    server.on_hello(b"b", _hello("B"), now=0)
    to_a = [server.next_chunk(5) for _ in range(2)]
    for c in to_a:
        server.on_sent(b"a", c.epochs, c.indices)
    _consume(server, b"a", [(to_a[0].epochs, to_a[0].indices)], now=1)  # A consumed one batch, reported it
    assert server.trainers.leave(b"a", session=2) is None and len(server.trainers) == 2  # not A's session: ignored
    assert server.trainers.leave(b"a", session=1) == "A"  # long before A's 600 s would run out
    assert list(server.trainers) == [b"b"] and (server.trainers.goodbyes, server.trainers.lost) == (1, 0)
    rest = _serve(server, b"b")
    served_b = sorted(i for _, idx in rest for i in idx)
    assert served_b == sorted(set(RECORDS) - set(to_a[0].indices))  # what A held, not what it consumed
    assert server.trainers.leave(b"a", session=1) is None  # a second goodbye finds nobody
    server.trainers.drop(b"b")
    assert (server.trainers.goodbyes, server.trainers.lost) == (1, 1)
