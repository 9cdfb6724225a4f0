"""Direct receive from many producers on a bounded number of threads (issue 41: a thousand producers per trainer).

Real libzmq PUSH sockets speak the real protocol on the other end; a real ``BatchStream`` receives.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import zmq

from stoker.consumer import BatchStream
from stoker.consumer.transport.connection_loop import MAX_THREADS
from stoker.protocol import encode_batch

from conftest import stoker_batch

BATCH, SHAPE, PRODUCERS, BATCHES_EACH = 2, (4, 4, 3), 32, 3


def _receive_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("stoker-receive-")]


def test_a_trainer_reading_32_producers_uses_at_most_8_receive_threads_and_gets_every_batch_once():
    ctx = zmq.Context()
    pushes, addresses = [], []
    for _ in range(PRODUCERS):
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDTIMEO, 30_000)  # a receiver that never connects fails here, not at the test's limit
        addresses.append(f"tcp://127.0.0.1:{push.bind_to_random_port('tcp://127.0.0.1')}")
        pushes.append(push)
    try:
        with BatchStream(addresses, batch_size=BATCH, image_shape=SHAPE, recv_timeout=30, receive="direct") as stream:
            for p, push in enumerate(pushes):
                for b in range(BATCHES_EACH):
                    first = (p * BATCHES_EACH + b) * BATCH
                    images = np.full((BATCH, *SHAPE), first % 251, np.uint8)
                    push.send_multipart(encode_batch(stoker_batch(images, np.arange(BATCH), first), producer=f"p{p}",
                                                     seq=b), copy=False)
            seen: Counter = Counter()
            most_threads = 0
            for _, batch in zip(range(PRODUCERS * BATCHES_EACH), stream):
                seen.update(batch["index"].tolist())
                assert (batch["images"] == batch["index"][0] % 251).all()
                most_threads = max(most_threads, len(_receive_threads()))
            assert stream.stats.connected_producers == PRODUCERS
        assert seen == Counter(range(PRODUCERS * BATCHES_EACH * BATCH))  # every row once, none twice
        assert 1 <= most_threads <= MAX_THREADS == 8, most_threads
        assert not _receive_threads()  # closed: the loop's threads are gone
    finally:
        for push in pushes:
            push.close(0)
        ctx.term()


def test_a_libzmq_context_for_many_producers_opens_past_the_1023_default_and_refuses_past_its_limit():
    from stoker.consumer.transport.libzmq_receiver import libzmq_context

    wanted = 1100  # more than libzmq's default of 1,023 sockets a context
    default = zmq.Context()
    limit = default.get(zmq.SOCKET_LIMIT)
    assert default.get(zmq.MAX_SOCKETS) < wanted <= limit  # what the sized context is for
    default.term()
    ctx = libzmq_context(wanted)
    sockets = []
    try:
        for _ in range(wanted):
            sockets.append(ctx.socket(zmq.PAIR))
    finally:
        for sock in sockets:
            sock.close(0)
        ctx.term()
    assert len(sockets) == wanted
    with pytest.raises(ValueError, match=f"at most {limit} in one context"):
        libzmq_context(limit + 1)


def test_an_exact_libzmq_link_past_its_contexts_sockets_is_refused_by_name():
    from stoker.consumer.exact.links import LibzmqDealer
    from stoker.protocol import DecodeLimits

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3)  # one link: its DEALER and its monitor's two PAIRs
    links = [LibzmqDealer(ctx, "tcp://127.0.0.1:9", [(zmq.LINGER, 0)], DecodeLimits())]
    try:
        with pytest.raises(ValueError, match="cannot open a socket for tcp://127.0.0.1:10.*at most 3 sockets"):
            links.append(LibzmqDealer(ctx, "tcp://127.0.0.1:10", [(zmq.LINGER, 0)], DecodeLimits()))
    finally:
        for link in links:
            link.close(0)
        ctx.term()
