"""A hello carries only the progress of the stream its producer serves (issue 41), and exactness holds.

Raw ROUTERs stand in for producers where a test is about what the trainer sends (the hellos' bytes and
streams); real producer daemons where it is about records served once.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from stoker.consumer import BatchStream
from stoker.consumer.exact.control_plane import ExactControlPlane
from stoker.consumer.exact.hello_state import hello_state
from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.links import LibzmqDealer
from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.protocol import DecodeLimits
from stoker.protocol.exact_messages import (Describe, Hello, Status, decode_trainer_message, encode_hello,
                                            encode_status)
from stoker.protocol.input_state import InputState

from conftest import assert_exactly_once, one_worker_producer, unused_port

pytestmark = pytest.mark.timeout(180)

STREAMS = ("0/2:10000:3", "1/2:10000:3")
POOL = "splits:10000:3"


def _mid_epoch() -> InputState:
    """Both fixed shards two epochs done and a third half consumed (a random half: a shuffled epoch's first half,
    whose bitmap does not compress away), and an elastic pool's progress beside them."""
    state = InputState()
    rng = np.random.default_rng(5)
    for key in (*STREAMS, POOL):
        progress = state.progress(key)
        progress.completed = 2
        progress.mark(2, rng.permutation(progress.size)[:progress.size // 2])
    return state


def _same(a: InputState, b: InputState) -> bool:
    return a.streams.keys() == b.streams.keys() and all(
        a.streams[k].completed == b.streams[k].completed and a.streams[k].open.keys() == b.streams[k].open.keys()
        and all(np.array_equal(a.streams[k].open[e], b.streams[k].open[e]) for e in a.streams[k].open)
        for k in a.streams)


def test_hello_state_picks_the_producers_stream_alone_and_copies_it():
    state = _mid_epoch()
    mine = hello_state(state, STREAMS[0])
    assert list(mine.streams) == [STREAMS[0]] and _same(mine, InputState({STREAMS[0]: state.streams[STREAMS[0]]}))
    position = int(np.flatnonzero(~state.streams[STREAMS[0]].open[2])[0])
    state.mark(STREAMS[0], [2], [2 * position])  # the ledger goes on marking: the hello's copy stays as it was
    assert state.streams[STREAMS[0]].open[2][position] and not mine.streams[STREAMS[0]].open[2][position]
    assert hello_state(state, POOL).streams == {}  # a pool's producers read no state: its work says what to skip
    assert hello_state(state, "0/4:1000:3").streams == {}  # a shard this trainer has no progress of: begun afresh
    assert _same(hello_state(state, ""), state)  # a producer naming no stream: everything, as before


def _routers(ctx: zmq.Context, n: int) -> list[tuple[zmq.Socket, str]]:
    out = []
    for _ in range(n):
        router = ctx.socket(zmq.ROUTER)
        out.append((router, f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"))
    return out


def _serve_until_hellos(plane: ExactControlPlane, routers: list[tuple[zmq.Socket, str]], streams: list[str],
                        sessions: int = 1) -> list[list[tuple[object, bytes]]]:
    """Drive the control plane (as the receiver's thread does) while each router answers a describe as a producer of
    its stream does, until each got ``sessions`` hellos; every message each received, decoded, with its bytes."""
    got: list[list[tuple[object, bytes]]] = [[] for _ in routers]
    for _ in range(1500):
        plane.watch()
        plane.flush()
        for i in plane.poll(0):
            plane.receive(i)
        for (router, _), stream, messages in zip(routers, streams, got):
            while router.poll(5):
                routing_id, body = router.recv_multipart()
                message = decode_trainer_message(body)
                messages.append((message, body))
                if isinstance(message, Describe):
                    router.send_multipart([routing_id, encode_status(Status(stream, "p", 0, None, False))])
                elif isinstance(message, Hello):  # as a producer does: its status of the new session
                    router.send_multipart([routing_id, encode_status(Status(stream, "p", 2, None, False,
                                                                            session=message.session))])
        if all(sum(isinstance(m, Hello) for m, _ in messages) >= sessions for messages in got):
            return got
    raise AssertionError(f"not every stand-in producer got {sessions} hello(s): {got}")


def _plane(ctx: zmq.Context, addresses: list[str], state: InputState) -> ExactControlPlane:
    return ExactControlPlane(lambda a: LibzmqDealer(ctx, a, [(zmq.LINGER, 0)], DecodeLimits()), addresses,
                             ConsumedLedger("t0", state), credit=4)


def test_a_trainer_reading_two_fixed_shards_sends_each_producer_only_its_streams_progress():
    ctx = zmq.Context()
    routers = _routers(ctx, 2)
    state = _mid_epoch()
    plane = _plane(ctx, [address for _, address in routers], state)
    try:
        plane.activate()  # before any status: the trainer does not know yet which stream each producer serves
        got = _serve_until_hellos(plane, routers, list(STREAMS))
        for stream, messages in zip(STREAMS, got):
            kinds = [type(m) for m, _ in messages]
            assert kinds.index(Describe) < kinds.index(Hello), "a hello went before the producer named its stream"
            hello, body = next((m, b) for m, b in messages if isinstance(m, Hello))
            assert list(hello.state.streams) == [stream]
            assert _same(hello.state, InputState({stream: state.streams[stream]}))
            whole = encode_hello(Hello(hello.trainer, hello.session, hello.credit, state, hello.held))
            # Its own shard's bitmap: a quarter of the whole state's (two shards of 5,000 records, a pool of 10,000).
            assert len(body) < len(whole) / 3, (len(body), len(whole))
        assert plane.control.bytes_sent < 2 * len(whole)  # describes, hellos, heartbeats: not twice the state
    finally:
        plane.close()
        for router, _ in routers:
            router.close(linger=0)
        ctx.term()


def test_a_producer_that_serves_another_stream_than_its_hello_named_is_told_its_own():
    """A producer restarted at the same address with another shard: the trainer's hello, cut for the stream it
    knew, told it nothing of the one it serves, so its status of that session brings a new hello with that one."""
    ctx = zmq.Context()
    routers = _routers(ctx, 1)
    state = _mid_epoch()
    plane = _plane(ctx, [routers[0][1]], state)
    try:
        plane.producers[0].stream = STREAMS[0]  # what an earlier incarnation at this address served
        plane.activate()
        got = _serve_until_hellos(plane, routers, [STREAMS[1]], sessions=2)[0]
        hellos = [m for m, _ in got if isinstance(m, Hello)]
        assert list(hellos[0].state.streams) == [STREAMS[0]] and hellos[0].session == 1
        assert list(hellos[1].state.streams) == [STREAMS[1]] and hellos[1].session == 2
        assert _same(hellos[1].state, InputState({STREAMS[1]: state.streams[STREAMS[1]]}))
    finally:
        plane.close()
        routers[0][0].close(linger=0)
        ctx.term()


def test_a_batch_of_another_stream_than_its_hello_carried_is_dropped_and_brings_a_new_hello():
    """The status that would say so can be lost (a producer sends it without waiting): a batch naming another fixed
    shard than the stream the session's hello was cut for is dropped (served again), and a new hello carries that
    stream's progress, once (the next session's batches are of the stream its hello carried)."""
    from stoker.protocol.batch_codec import encode_batch, with_session

    ctx = zmq.Context()
    routers = _routers(ctx, 1)
    state = _mid_epoch()
    plane = _plane(ctx, [routers[0][1]], state)
    try:
        plane.producers[0].stream = STREAMS[0]  # what an earlier incarnation at this address served
        plane.activate()
        router = routers[0][0]
        hellos = []
        for _ in range(1500):
            plane.watch()
            plane.flush()
            for i in plane.poll(0):
                message = plane.receive(i)
                if message is not None:
                    assert plane.admit(i, message, lambda b: list(b.arrays.values())) is None
            while router.poll(5):
                routing_id, body = router.recv_multipart()
                message = decode_trainer_message(body)
                if isinstance(message, Hello):  # no status: a batch of the stream it serves now, STREAMS[1]
                    hellos.append(message)
                    frames = encode_batch({"index": np.arange(2, dtype=np.int64)}, producer="p", seq=0,
                                          stream=STREAMS[1])
                    header = with_session(frames[0], stream=STREAMS[1], session=message.session)
                    router.send_multipart([routing_id, header, *frames[1:]])
            if len(hellos) >= 2:
                break
        assert [list(h.state.streams) for h in hellos] == [[STREAMS[0]], [STREAMS[1]]]
        assert plane.producers[0].hello_stream == STREAMS[1]
    finally:
        plane.close()
        routers[0][0].close(linger=0)
        ctx.term()


def test_an_elastic_pools_producer_gets_a_hello_without_state():
    ctx = zmq.Context()
    routers = _routers(ctx, 1)
    plane = _plane(ctx, [routers[0][1]], _mid_epoch())
    try:
        plane.activate()
        got = _serve_until_hellos(plane, routers, [POOL])[0]
        hello = next(m for m, _ in got if isinstance(m, Hello))
        assert hello.state.streams == {}
    finally:
        plane.close()
        routers[0][0].close(linger=0)
        ctx.term()


RECORDS = 50
BATCH = 4


@pytest.fixture(scope="module")
def small_lmdb(tmp_path_factory):
    path = tmp_path_factory.mktemp("hello") / "ds"
    build_synthetic(path, RECORDS, seed=2, num_classes=4, progress=False)
    return path


def _shard(dataset, shard: str, port: int):
    return one_worker_producer(dataset, batch=BATCH, size=16, bind=f"tcp://127.0.0.1:{port}",
                               flags=["--exact", "--seed", "3", "--shard", shard, "--epochs", "1"])


def _rows(batch: dict) -> list[tuple[int, int]]:
    return list(zip(batch["epoch"].tolist(), batch["index"].tolist()))


def test_fixed_shard_producers_restarted_fresh_resume_a_restored_trainers_epoch_with_each_record_once(small_lmdb):
    """The trainer resumes from a checkpoint and is saying hello before the new producer incarnations (which know
    nothing) are up: each must learn its own stream's consumed records from the hello, or it serves them again."""
    ports = [unused_port()]
    while len(ports) < 2:
        ports = list({*ports, unused_port()})
    with _shard(small_lmdb, "0/2", ports[0]) as a, _shard(small_lmdb, "1/2", ports[1]) as b:
        with BatchStream([a.endpoint, b.endpoint], exact=True, batch_size=BATCH, image_shape=(16, 16, 3),
                         recv_timeout=60) as first:
            before = [row for _ in range(4) for row in _rows(next(first))]
            state = first.save_state()
    rest: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    second = BatchStream([f"tcp://127.0.0.1:{p}" for p in ports], exact=True, batch_size=BATCH,
                         image_shape=(16, 16, 3), recv_timeout=60, resume_state=state)

    def consume() -> None:
        try:
            rest.extend(row for batch in second for row in _rows(batch))
        except BaseException as exc:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(exc)

    thread = threading.Thread(target=consume)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while not second._ledger.started:  # active: every connection made from now on gets a hello
            assert time.monotonic() < deadline, "the second trainer never took its first batch"
            thread.join(0.01)
        with _shard(small_lmdb, "0/2", ports[0]), _shard(small_lmdb, "1/2", ports[1]):
            thread.join(120)
            assert not thread.is_alive(), "the resumed trainer did not finish the epoch"
    finally:
        second.close()
        thread.join(10)
    assert not errors, errors
    assert len(before) > BATCH  # the first trainer consumed part of the epoch; the second resumed the rest
    assert_exactly_once(before + rest, set(range(RECORDS)))
