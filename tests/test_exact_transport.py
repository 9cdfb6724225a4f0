"""The trainer's exact-mode transport against a real ROUTER: no handshake unseen, no request taken as delivered."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from stoker.consumer.exact_transport import ExactTransport
from stoker.protocol.exact_messages import Describe, decode_trainer_message
from stoker.protocol.input_state import InputState


def _router(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def _wait_for_handshake(monitor: zmq.Socket) -> None:
    while True:
        assert monitor.poll(10_000), "the trainer never completed a handshake"
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return


def _next_describe(router: zmq.Socket, transport: ExactTransport) -> bytes:
    """Drive the transport (as ZMQInput's thread does) until the router receives a describe."""
    for _ in range(1000):  # each round waits up to 20 ms for the router
        transport.watch()
        if router.poll(20):
            routing_id, body = router.recv_multipart()
            assert isinstance(decode_trainer_message(body), Describe)
            return routing_id
    raise AssertionError("the trainer never asked the producer to describe itself")


def test_a_handshake_finished_before_the_trainer_looks_is_seen_and_an_unanswered_describe_is_asked_again():
    ctx = zmq.Context()
    router, address = _router(ctx)
    monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    transport = ExactTransport(ctx, [address], "t0", InputState(), credit=4, options=[(zmq.LINGER, 0)])
    try:
        # The handshake completes before the transport polls a single monitor event: it must still count.
        _wait_for_handshake(monitor)
        first = _next_describe(router, transport)
        # The producer never answers (lost, or it restarted): the trainer asks again rather than wait for ever.
        assert _next_describe(router, transport) == first
        assert transport.watchers[0].handshakes == 1
    finally:
        transport.close()
        router.disable_monitor()
        monitor.close(linger=0)
        router.close(linger=0)
        ctx.term()
