"""Exact mode's direct link (``DirectDealer``) against real libzmq sockets: what a producer's ROUTER sends arrives in
aligned memory, what the trainer sends reaches the ROUTER, the inbox is bounded, bad messages are counted and the
stream goes on, a plain producer is named as a mode mismatch, and nothing waits for a peer that does not read."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import zmq

from stoker.consumer.exact.direct_dealer import DirectDealer
from stoker.consumer.receive.contract import aligned_empty
from stoker.consumer.transport.zmtp_wire import GREETING
from stoker.protocol import DecodeLimits, ProtocolError
from stoker.protocol.batch_codec import encode_batch
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.exact_messages import Credit, Status, decode_trainer_message, encode_credit, encode_status

pytestmark = pytest.mark.timeout(120)

SPEC = BatchSpec.from_dict({"images": ("uint8", [2, 8, 8, 3]), "labels": ("int32", [2])})


def _batch(seq: int, labels_shape: tuple[int, ...] = (2,)) -> list:
    arrays = {"images": np.full((2, 8, 8, 3), seq, np.uint8), "labels": np.full(labels_shape, seq, np.int32)}
    return encode_batch(arrays, producer="p0", seq=seq)


def _status() -> bytes:
    return encode_status(Status("0/1:10:0", "p0", 0, None, False))


@pytest.fixture
def router():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


def _link(address: str, batch_room: int = 4) -> DirectDealer:
    return DirectDealer(address, lambda: SPEC, DecodeLimits(), aligned_empty, batch_room=batch_room, status_room=8)


def _until(condition, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _routing_id(sock: zmq.Socket, link: DirectDealer) -> bytes:
    """The ROUTER learns the link's routing id from its first message."""
    _until(lambda: link.watch() or link.connected, "the link never connected")
    assert link.send(encode_credit(Credit(1, 0)))
    assert sock.poll(10_000), "the ROUTER never received the link's message"
    routing_id, body = sock.recv_multipart()
    assert isinstance(decode_trainer_message(body), Credit)
    return routing_id


def _next(link: DirectDealer, poller: zmq.Poller):
    assert poller.poll(10_000), "nothing arrived"
    return link.receive()


def test_messages_go_both_ways_and_batches_land_in_aligned_memory(router):
    sock, address = router
    link = _link(address)
    try:
        routing_id = _routing_id(sock, link)
        assert link.handshakes == 1 and link.connected == {address}
        poller = zmq.Poller()
        poller.register(link.pollable, zmq.POLLIN)
        sock.send(routing_id, zmq.SNDMORE)
        sock.send(_status())
        sock.send_multipart([routing_id, *_batch(7)], copy=False)
        status, nbytes = _next(link, poller)
        assert status["t"] == "status" and nbytes == len(_status())
        batch = _next(link, poller)
        assert isinstance(batch, Batch) and int(batch["labels"][0]) == 7
        assert batch["images"].ctypes.data % 64 == 0 and batch["labels"].ctypes.data % 64 == 0
        assert not poller.poll(0)  # the pipe is readable exactly while a message waits
    finally:
        _close(link)


def _close(link: DirectDealer) -> None:
    link.close(linger_ms=0)
    link.join(5.0)
    assert link._gone.is_set()  # the loop closed the connection and the pipe
    assert not [t for t in threading.enumerate() if t.name.startswith(f"stoker-exact-{link.address}")]


def test_the_inbox_holds_at_most_batch_room_batches_and_loses_none(router):
    sock, address = router
    link = _link(address, batch_room=2)
    try:
        routing_id = _routing_id(sock, link)
        for seq in range(6):  # more than credit allows: a producer that ignores it is held back by TCP
            sock.send_multipart([routing_id, *_batch(seq)], copy=False)
        _until(lambda: link._batches == 2, "the link never filled its inbox")
        time.sleep(0.3)  # a reader that ignored the bound would take a third batch meanwhile
        assert link._batches == 2
        poller = zmq.Poller()
        poller.register(link.pollable, zmq.POLLIN)
        seen = []
        for _ in range(6):
            assert poller.poll(10_000)
            seen.append(int(link.receive()["labels"][0]))
        assert seen == list(range(6))
    finally:
        _close(link)


def test_a_batch_off_the_spec_is_refused_and_the_next_one_arrives(router):
    sock, address = router
    link = _link(address)
    try:
        routing_id = _routing_id(sock, link)
        sock.send_multipart([routing_id, *_batch(1, labels_shape=(3,))], copy=False)
        sock.send_multipart([routing_id, *_batch(2)], copy=False)
        poller = zmq.Poller()
        poller.register(link.pollable, zmq.POLLIN)
        with pytest.raises(ProtocolError, match="labels"):
            _next(link, poller)
        assert int(_next(link, poller)["labels"][0]) == 2
        assert link.handshakes == 1  # read past by its frame sizes: the connection stayed
    finally:
        _close(link)


def test_a_plain_producer_is_named_as_a_mode_mismatch():
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    link = _link(f"tcp://127.0.0.1:{port}")
    try:
        _until(lambda: link.health.mismatches().get(link.address, 0) >= 2, "no mode mismatch counted")
        assert "--exact" in link.health.summary()[2] and link.handshakes == 0
    finally:
        _close(link)
        push.close(linger=0)
        ctx.term()


def test_sending_to_a_peer_that_reads_nothing_never_waits():
    """A peer that finished the handshake and then stops reading: every send returns, the bytes wait in the link."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    accepted: list[socket.socket] = []

    def serve() -> None:
        peer, _ = listener.accept()
        accepted.append(peer)
        peer.sendall(GREETING[:12] + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        ready = b"\x05READY" + bytes([11]) + b"Socket-Type" + (6).to_bytes(4, "big") + b"ROUTER"
        peer.sendall(bytes([0x04, len(ready)]) + ready)
        # and never reads again

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    link = _link(address)
    try:
        _until(lambda: link.connected, "the link never connected")
        frame = b"x" * (1 << 20)
        sent = 0
        while link._up is not None and link._up.unsent == 0:  # until the kernel's buffers are full
            assert link.send(frame)
            sent += 1
            assert sent < 10_000, "the peer's kernel took gigabytes"
        assert link.send(frame)  # queued behind the rest, returns at once
        assert link._up is not None and link._up.unsent >= len(frame)
    finally:
        _close(link)
        for peer in accepted:
            peer.close()
        listener.close()


def test_a_send_on_a_connection_the_reader_just_closed_is_refused_not_raised(router):
    """The transport's thread may hold a connection the reader closes under it (a producer restarting)."""
    from stoker.consumer.transport.zmtp import ZMTPConnection

    _, address = router
    conn = ZMTPConnection(address, lambda: False, socket_type="DEALER")
    conn.close()
    with pytest.raises(ConnectionError):
        conn.send(b"credit")
    conn.flush()  # nothing queued: nothing to do
    conn.shutdown()  # harmless once closed


def test_a_connection_waiting_for_inbox_room_is_not_taken_for_a_stalled_peer(router):
    """A full inbox (a slow step, a checkpoint) stops the reading between messages, however long: the producer is
    not dropped for silence (that would start a new session and serve its batches again), and reading resumes."""
    sock, address = router
    link = _link(address, batch_room=1)
    link._connection._stall_s = 0.2  # the stall limit (30 s) made short; the wait below outlasts it many times
    try:
        routing_id = _routing_id(sock, link)
        for seq in range(2):
            sock.send_multipart([routing_id, *_batch(seq)], copy=False)
        _until(lambda: link._batches == 1, "the link never filled its inbox")
        time.sleep(1.0)  # five stall limits with the inbox full: the loop ticks every 0.1 s meanwhile
        poller = zmq.Poller()
        poller.register(link.pollable, zmq.POLLIN)
        assert [int(_next(link, poller)["labels"][0]) for _ in range(2)] == [0, 1]
        assert link.handshakes == 1 and link.health.reconnects == 0
    finally:
        _close(link)


def test_a_dealer_on_a_closed_loop_is_refused_as_a_bad_address_is():
    """The control plane counts a joining producer's ValueError as its connection error (the input is stopping)."""
    from stoker.consumer.transport.connection_loop import ConnectionLoop

    loop = ConnectionLoop("stoker-exact-test", 0.1, lambda endpoint, exc: None)
    loop.close()
    with pytest.raises(ValueError, match="tcp://127.0.0.1:9: the input is closing"):
        DirectDealer("tcp://127.0.0.1:9", lambda: SPEC, DecodeLimits(), aligned_empty, 4, 8, loop=loop)
