"""ZMQInput(receive="direct"): producers' streams read over ZMTP straight into aligned memory TensorFlow owns.

Real producer processes, real libzmq PUSH sockets on the other end, real TensorFlow.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
import itertools
from collections import Counter, defaultdict

import msgpack
import numpy as np
import pytest
import tensorflow as tf
import zmq

from stoker.consumer import InputTimeoutError, ZMQInput
from stoker.protocol import encode_batch

from conftest import CHECKSUM_WEIGHTS as WEIGHTS, EVAL_SIZE as SIZE, SYNTH_COUNT, count_rows, stoker_batch, one_worker_producer

pytestmark = pytest.mark.timeout(180)

BATCH = 8
SHAPE = (SIZE, SIZE, 3)


_producer = functools.partial(one_worker_producer, batch=BATCH, size=SIZE, flags=("--log-interval", "1"))


def test_every_record_arrives_once_per_epoch_with_the_pixels_the_eval_transform_makes(synth_lmdb, record_by_checksum):
    weights = tf.constant(WEIGHTS)
    per_shard: dict[int, list[int]] = defaultdict(list)
    with _producer(synth_lmdb, "--mode", "eval", "--shard", "0/2", "--seed", "1") as p0, \
            _producer(synth_lmdb, "--mode", "eval", "--shard", "1/2", "--seed", "2") as p1, \
            ZMQInput([p0.endpoint, p1.endpoint], batch_size=BATCH, image_shape=SHAPE, recv_timeout=30,
                     receive="direct") as inp:

        @tf.function
        def step():
            images, labels = inp.get()
            return tf.reduce_sum(tf.cast(images, tf.int64) * weights[None], axis=[1, 2, 3]), labels

        # Until each shard's first epoch is in: one producer may start sending well before the other.
        deadline = time.monotonic() + 90
        while min(len(per_shard[0]), len(per_shard[1])) < 48:
            assert time.monotonic() < deadline, {k: len(v) for k, v in per_shard.items()}
            checksums, labels = step()
            for checksum, label in zip(checksums.numpy(), labels.numpy()):
                index, true_label = record_by_checksum[int(checksum)]  # KeyError: an image no record produces
                assert label == true_label
                per_shard[index % 2].append(index)
        stats = inp.stats
        assert stats.protocol_errors == 0 and len(stats.per_producer) == 2
        assert stats.connected_producers == 2 and set(stats.connected_endpoints) == {p0.endpoint, p1.endpoint}
    for shard, stream in per_shard.items():
        records = set(range(shard, 96, 2))
        assert sorted(stream[:len(records)]) == sorted(records), f"shard {shard}"


def test_bad_messages_are_rejected_and_counted_and_the_stream_goes_on():
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 30_000)  # a receiver that never connects fails here, not at the test's limit
    port = push.bind_to_random_port("tcp://127.0.0.1")
    images = np.arange(BATCH * SIZE * SIZE * 3, dtype=np.uint64).astype(np.uint8).reshape(BATCH, *SHAPE)
    good = encode_batch(stoker_batch(images, np.arange(BATCH)), producer="fake", seq=9)
    wrong_shape = encode_batch(stoker_batch(images[:4], np.arange(4)), producer="fake", seq=1)
    header = msgpack.unpackb(good[0])
    header["arrays"][0]["shape"] = [BATCH, SIZE, SIZE, 2]  # another shape: held to the spec before any read
    other_shape = [msgpack.packb(header), *good[1:]]
    short_frame = [good[0], images.tobytes()[:-1], *good[2:]]  # the frame is not what its header declares
    header["arrays"][0]["shape"] = [2**64 - 1, 2**40, 2**40]  # no numpy array could have this shape
    header["arrays"][1]["shape"] = [3]
    monstrous = [msgpack.packb(header), *good[1:]]
    try:
        with ZMQInput([f"tcp://127.0.0.1:{port}"], batch_size=BATCH, image_shape=SHAPE, recv_timeout=30,
                      receive="direct") as inp:
            for message in ([b"\x93not msgpack", *good[1:]], wrong_shape, [good[0]], other_shape, short_frame,
                            monstrous, [*good, b"extra"], good, good):  # get() stages one batch ahead: two
                push.send_multipart(message, copy=False)
            batch = inp.get()
            np.testing.assert_array_equal(batch["images"].numpy(), images)
            assert batch["index"].numpy().tolist() == list(range(BATCH))
            stats = inp.stats
            # not msgpack, a header alone, a short frame, an extra frame; three other batch shapes
            assert stats.protocol_errors == 4 and stats.mismatched_batches == 3, stats
            assert stats.connected_producers == 1 and stats.reconnects == 0  # every bad message was read past
    finally:
        push.close(0)
        ctx.term()


def test_direct_receive_is_the_default_for_tcp_and_learns_the_spec_from_the_first_batch(synth_lmdb):
    with _producer(synth_lmdb, "--mode", "eval") as producer, ZMQInput([producer.endpoint], recv_timeout=30) as inp:
        assert inp.receive == "direct"
        assert inp.spec["images"].shape == (BATCH, *SHAPE) and inp.batch_size == BATCH
        images, labels = inp.get()
        assert images.shape == (BATCH, *SHAPE) and labels.shape == (BATCH,)
        assert inp.max_batches_held() == 50 + 3 + 2 + 1  # one batch per producer, not rcvhwm + 1
    with ZMQInput(["ipc:///tmp/stoker-not-there"], batch_size=BATCH, recv_timeout=5) as inp:
        assert inp.receive == "direct"  # a Unix socket too: a producer on this host


@pytest.mark.parametrize("exact", [False, True])
def test_direct_receive_reads_a_producer_on_this_host_over_its_unix_socket(synth_lmdb, tmp_path, exact):
    """ipc:// (libzmq's Unix socket transport, what a local producer binds) is read by direct receive, plain and
    exact: every record of an epoch arrives once."""
    from stoker.consumer import BatchStream

    endpoint = f"ipc://{tmp_path}/producer.sock"
    flags = ("--mode", "eval", "--exact", "--epochs", "1") if exact else ("--mode", "eval")
    with _producer(synth_lmdb, *flags, bind=endpoint) as producer, \
            BatchStream([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), exact=exact,
                        recv_timeout=30) as stream:
        assert stream.receive == "direct" and producer.endpoint == endpoint
        seen: Counter = Counter()
        for batch in itertools.islice(stream, 200):
            rows = batch["mask"] if exact else slice(None)
            count_rows({k: v[rows] for k, v in batch.items()}, seen)
            if not exact and sum(seen.values()) >= 2 * SYNTH_COUNT:
                break
        assert stream.stats.protocol_errors == 0 and stream.stats.connected_producers == 1
    if exact:
        assert sorted(seen) == [(0, i) for i in range(SYNTH_COUNT)] and set(seen.values()) == {1}
    else:
        assert {i for _, i in seen} == set(range(SYNTH_COUNT))


@pytest.mark.parametrize("kwargs, message", [
    (dict(receive="fast"), "choose 'auto'"),
    (dict(receive="direct", curve=True), "without CurveZMQ"),
])
def test_what_direct_receive_cannot_do_is_refused_with_the_fix(kwargs, message, tmp_path):
    from stoker.protocol.curve import generate_keypair, load_client_keys

    args = dict(batch_size=BATCH, recv_timeout=5)
    args.update(kwargs)
    if args.get("curve"):
        _, secret = generate_keypair(tmp_path, "trainer")
        server_public, _ = generate_keypair(tmp_path, "producer")
        args["curve"] = load_client_keys(secret, server_public)
    if args["batch_size"] is None:
        del args["batch_size"]
    with pytest.raises(ValueError, match=message):
        ZMQInput(["tcp://127.0.0.1:1"], **args)
    with pytest.raises(ValueError, match="TCP and ipc:// only"):
        ZMQInput(["udp://127.0.0.1:5555"], batch_size=BATCH, receive="direct")
    with pytest.raises(ValueError, match="socket path of 1-107 bytes"):
        ZMQInput(["ipc://" + "x" * 200], batch_size=BATCH, receive="direct")


def test_a_refused_or_foreign_peer_times_out_naming_what_went_wrong():
    server = socket.create_server(("127.0.0.1", 0))
    foreign = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    held = socket.socket()  # bound, never listening: connecting is refused, and no one else gets the port
    held.bind(("127.0.0.1", 0))
    refused = f"tcp://127.0.0.1:{held.getsockname()[1]}"
    stop = threading.Event()

    def speak_http() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(10)
                try:
                    conn.recv(64)  # the greeting, read before answering: a clean close, no reset
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n" + b" " * 64)
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(4096)
                except OSError:
                    pass

    thread = threading.Thread(target=speak_http, daemon=True)
    thread.start()
    try:
        with ZMQInput([foreign, refused], batch_size=BATCH, image_shape=SHAPE, recv_timeout=5,
                      receive="direct") as inp:
            with pytest.raises(InputTimeoutError) as info:
                inp.get()
            assert inp.stats.handshake_failures >= 1 and inp.stats.connected_producers == 0
        text = str(info.value)
        assert f"cannot receive from {foreign}: {foreign} does not speak ZMTP" in text
        assert f"cannot receive from {refused}: ConnectionRefusedError" in text
    finally:
        stop.set()
        thread.join(5)
        server.close()
        held.close()


def test_a_killed_producer_is_connected_again_when_it_comes_back(synth_lmdb):
    producer = _producer(synth_lmdb, "--seed", "5")
    try:
        with ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=SHAPE, recv_timeout=60,
                      receive="direct") as inp:
            for _ in range(3):
                inp.get()
            producer.kill()
            producer = _producer(synth_lmdb, "--seed", "6", bind=producer.endpoint)
            deadline = time.monotonic() + 60
            # The old connection dropped (a reconnect is counted then) and a new one is up: every batch
            # received from now on comes from the new incarnation.
            while not (inp.stats.reconnects >= 1 and inp.stats.connected_producers == 1):
                assert time.monotonic() < deadline, inp.stats
                inp.get()
            received = inp.stats.batches
            while inp.stats.batches == received:
                assert time.monotonic() < deadline, inp.stats
                inp.get()
            assert inp.stats.protocol_errors == 0
    finally:
        producer.stop()


@pytest.mark.timeout(300)
def test_stoker_train_receives_directly_and_refuses_direct_with_curve_keys(synth_lmdb, tmp_path):
    import subprocess
    import sys

    with _producer(synth_lmdb, "--seed", "7") as producer:
        out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--connect", producer.endpoint,
                              "--receive", "direct", "--steps", "20", "--batch-size", str(BATCH), "--image-size",
                              str(SIZE), "--classes", "4", "--no-progress", "--recv-timeout", "60"],
                             capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 20 steps" in out.stdout and "rejected: 0" in out.stdout
    from stoker.protocol.curve import generate_keypair

    _, secret = generate_keypair(tmp_path, "trainer")
    server_public, _ = generate_keypair(tmp_path, "producer")
    refused = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--connect", "tcp://127.0.0.1:1",
                              "--receive", "direct", "--curve-secret-key", str(secret), "--curve-server-key",
                              str(server_public)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--receive direct works without CurveZMQ keys" in refused.stderr


@pytest.mark.parametrize("endpoint, address", [
    ("tcp://datahost:5555", ("datahost", 5555)),
    ("tcp://[::1]:7", ("::1", 7)),
    ("ipc:///tmp/stoker.sock", "/tmp/stoker.sock"),
    ("ipc://relative.sock", "relative.sock"),
    ("ipc://@stoker-abstract", "\0stoker-abstract"),
])
def test_direct_receive_addresses_are_tcp_or_a_unix_socket(endpoint, address):
    from stoker.consumer.receive.stream_address import stream_address

    assert stream_address(endpoint) == address


@pytest.mark.parametrize("endpoint", ["ipc://", "ipc://@", "ipc://" + "p" * 108, "ipc://a\0b", "tcp://host",
                                      "inproc://x", "datahost:5555"])
def test_what_direct_receive_cannot_reach_is_refused_naming_the_form(endpoint):
    from stoker.consumer.receive.stream_address import stream_address

    with pytest.raises(ValueError, match="ipc://"):
        stream_address(endpoint)


def test_a_unix_socket_whose_backlog_is_full_is_a_refusal_not_a_connect_in_progress(tmp_path):
    """EAGAIN from a non-blocking connect on a Unix socket means the listener takes no more for now; taken as a
    connect under way, the socket would poll writable, look connected and fail later with a misleading error."""
    import errno

    from stoker.consumer.receive.stream_address import connect_failure, open_stream

    path = str(tmp_path / "full.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first.connect(path)  # takes the one place a backlog of 0 leaves
    sock, address = open_stream(path)
    try:
        error = sock.connect_ex(address)
        assert error == errno.EAGAIN
        failure = connect_failure(sock, error, f"ipc://{path}")
        assert isinstance(failure, OSError) and "backlog is full" in str(failure)
        assert connect_failure(sock, errno.EINPROGRESS, "tcp://h:1") is not None  # no background connect either
        tcp = socket.socket()
        assert connect_failure(tcp, errno.EINPROGRESS, "tcp://h:1") is None
        tcp.close()
    finally:
        for s in (sock, first, server):
            s.close()
