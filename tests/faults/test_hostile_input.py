"""Hostile input against a live ZMQInput: every bad message is refused and counted, nothing else is lost."""

from __future__ import annotations

import resource
import time

import msgpack
import numpy as np
import pytest
import zmq

from conftest import stoker_batch
from stoker.consumer import ZMQInput
from stoker.protocol import PROTOCOL_VERSION, encode_batch

pytestmark = pytest.mark.timeout(300)

B, S = 4, 16
FUZZ_MESSAGES = 100_000
GOOD_EVERY = 5_000


def _header(arrays, **kw):
    h = {"v": PROTOCOL_VERSION, "producer": "fuzz", "seq": 0, "arrays": arrays}
    h.update(kw)
    return msgpack.packb(h)


def malformed_messages(rng: np.random.Generator, good: list):
    """An endless mix of broken messages: random, truncated, lying about shapes, dtypes and versions."""
    img = {"name": "images", "dtype": "uint8", "shape": [B, S, S, 3]}
    lab = {"name": "labels", "dtype": "int32", "shape": [B]}
    kinds = [
        lambda: [rng.bytes(int(rng.integers(0, 64)))],
        lambda: [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(2, 5)))],
        lambda: good[: int(rng.integers(1, len(good)))],                       # truncated: frames missing
        lambda: [good[0], bytes(good[1])[: int(rng.integers(0, 100))], good[2]],  # truncated array frame
        lambda: [*good, b"extra"],
        lambda: [_header([{**img, "shape": [2**40, 2**40, 2**40, 3]}, lab]), good[1], good[2]],  # huge shape
        lambda: [_header([{**img, "shape": [-1, S, S, 3]}, lab]), good[1], good[2]],
        lambda: [_header([{**img, "dtype": rng.choice(["object", "V8", "<U4", "complex128", "O"])}, lab]), good[1], good[2]],
        lambda: [_header([img, lab], v=int(rng.integers(2, 1000))), good[1], good[2]],
        lambda: [_header([{**img, "shape": [B, S, S]}, lab]), bytes(B * S * S), good[2]],  # well-formed, wrong shape
        lambda: [msgpack.packb(rng.integers(0, 255, 8).tolist()), good[1], good[2]],
        lambda: [_header("not a list"), good[1]],
    ]
    while True:
        yield kinds[int(rng.integers(0, len(kinds)))]()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def test_100k_malformed_messages_are_all_rejected_and_counted_while_good_batches_flow():
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1_000)  # the receiver paces us: the RSS below is the receiver's, not our send queue
    port = push.bind_to_random_port("tcp://127.0.0.1")
    rng = np.random.default_rng(0)
    template = stoker_batch(np.zeros((B, S, S, 3), np.uint8), np.zeros(B, np.int32))
    good = [bytes(memoryview(f)) for f in encode_batch(template, producer="good", seq=0)]
    try:
        with ZMQInput([f"tcp://127.0.0.1:{port}"], batch_size=B, image_shape=(S, S, 3), queue_capacity=200,
                      recv_timeout=60, max_message_bytes=1 << 20) as inp:
            bad = malformed_messages(rng, good)
            sent_good, rss = 0, []
            for i in range(FUZZ_MESSAGES):
                push.send_multipart(next(bad))
                if i % GOOD_EVERY == 0:
                    marked = stoker_batch(np.full((B, S, S, 3), sent_good % 250, np.uint8),
                                          np.full(B, sent_good, np.int32))
                    push.send_multipart(encode_batch(marked, producer="good", seq=sent_good))
                    sent_good += 1
                if i % 20_000 == 0:
                    rss.append(_rss_mib())
            push.send_multipart(encode_batch(template, producer="good", seq=sent_good))  # get() stages one ahead
            deadline = time.monotonic() + 120
            while inp.stats.protocol_errors + inp.stats.mismatched_batches < FUZZ_MESSAGES:
                assert time.monotonic() < deadline, f"only {inp.stats} after 120 s"
                time.sleep(0.1)
            received = [int(inp.get()[1].numpy()[0]) for _ in range(sent_good)]
            stats = inp.stats
            rss.append(_rss_mib())
    finally:
        push.close(0)
        ctx.term()
    assert received == list(range(sent_good)), "good batches lost or reordered between bad ones"
    assert stats.protocol_errors + stats.mismatched_batches == FUZZ_MESSAGES
    assert stats.batches == sent_good + 1
    # Memory stays flat: nothing accumulates per rejected message (allow allocator noise).
    assert max(rss[1:]) - rss[1] < 64, f"RSS MiB over the run: {rss}"


def test_huge_claimed_shape_is_refused_before_any_allocation():
    from stoker.protocol import ProtocolError, decode_batch

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    header = _header([{"name": "images", "dtype": "float64", "shape": [2**31, 2**31, 2**31]}])
    with pytest.raises(ProtocolError, match="frame has 8"):
        decode_batch([header, b"\x00" * 8])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 10_000  # KiB


@pytest.mark.parametrize("receive", ["libzmq", "auto"])
def test_message_over_the_socket_limit_never_reaches_python_and_the_peer_recovers(receive):
    """libzmq drops an oversized frame (and the connection) itself; direct receive, the default, reads
    past the message without keeping it, counts it, and the same connection goes on."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZMQInput([f"tcp://127.0.0.1:{port}"], batch_size=B, image_shape=(S, S, 3), recv_timeout=30,
                      max_message_bytes=64 * 1024, receive=receive) as inp:
            push.send_multipart([b"x", bytes(1 << 20)])  # 1 MiB frame: ZMQ_MAXMSGSIZE drops it and the connection
            ok = stoker_batch(np.ones((B, S, S, 3), np.uint8), np.arange(B, dtype=np.int32))
            deadline = time.monotonic() + 30
            while inp.stats.batches < 2 and time.monotonic() < deadline:
                try:
                    push.send_multipart(encode_batch(ok, producer="p", seq=0), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no peer until ZMQInput re-connects
                time.sleep(0.2)
            stats = inp.stats
            if receive == "libzmq":  # libzmq drops the connection for good on MAXMSGSIZE; ZMQInput re-connects
                assert stats.batches >= 2 and stats.protocol_errors == 0 and stats.reconnects >= 1
            else:
                assert stats.batches >= 2 and stats.protocol_errors == 1
                assert "larger than the 65536 bytes allowed" in stats.last_error
            assert int(inp.get()[0].numpy().max()) == 1
    finally:
        push.close(0)
        ctx.term()


def test_link_measurement_gives_up_on_a_peer_that_sends_only_malformed_messages():
    """`stoker bench link` and `doctor` must end like the trainer does, whatever keeps arriving."""
    import threading

    from stoker.consumer import InputTimeoutError
    from stoker.consumer.train.throughput import measure_link

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 10)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            try:
                push.send_multipart([b"not a header", b"x"], flags=zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    try:
        # The trainer's own error and words (measure_link receives through BatchStream).
        with pytest.raises(InputTimeoutError, match=r"no acceptable batch .* for 2 s .*; \d+ message\(s\) arrived and "
                                                    r"were rejected, the last one because: header is not valid"):
            measure_link([f"tcp://127.0.0.1:{port}"], seconds=1, timeout=2)
    finally:
        stop.set()
        sender.join(5)
        push.close(0)
        ctx.term()
