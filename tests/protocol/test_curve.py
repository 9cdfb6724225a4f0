"""CurveZMQ: only a trainer holding an authorised key receives batches, and traffic is encrypted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from stoker.consumer import InputTimeoutError, ZMQInput
from stoker.producer.process import ProducerProcess
from stoker.protocol.curve import KeyFileError, generate_keypair, load_client_keys, load_server_keys

from conftest import wait_for_producer_log

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def keys(tmp_path):
    server_public, server_secret = generate_keypair(tmp_path / "server", "producer")
    allowed = tmp_path / "allowed"
    client_public, client_secret = generate_keypair(allowed, "trainer")
    _, stranger_secret = generate_keypair(tmp_path / "stranger", "stranger")
    # The authorised folder holds public keys only.
    client_secret.rename(tmp_path / "trainer.key_secret")
    return {"server_public": server_public, "server_secret": server_secret, "allowed": allowed,
            "client_secret": tmp_path / "trainer.key_secret", "stranger_secret": stranger_secret}


def _batches_within(inp: ZMQInput, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and inp.stats.batches == 0:
        time.sleep(0.1)
    return inp.stats.batches


def test_only_a_trainer_with_an_authorised_key_receives_batches(synth_lmdb, keys):
    args = ["--workers", "1", "--batch-size", "4", "--image-size", "16",
            "--curve-secret-key", str(keys["server_secret"]), "--curve-authorized-keys", str(keys["allowed"])]
    shape = dict(batch_size=4, image_shape=(16, 16, 3), recv_timeout=30)
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        with ZMQInput([producer.endpoint], **shape) as plain:
            assert _batches_within(plain, 3) == 0, "a trainer without keys received data"
        stranger = load_client_keys(keys["stranger_secret"], keys["server_public"])
        with ZMQInput([producer.endpoint], curve=stranger, **shape) as inp:
            assert _batches_within(inp, 3) == 0, "a trainer with an unauthorised key received data"
        authorised = load_client_keys(keys["client_secret"], keys["server_public"])
        with ZMQInput([producer.endpoint], curve=authorised, **shape) as inp:
            assert _batches_within(inp, 20) > 0
            images, labels = inp.get()
            assert images.shape == (4, 16, 16, 3)


def test_key_file_mistakes_are_named(tmp_path, keys):
    with pytest.raises(KeyFileError, match="holds no secret key"):
        load_server_keys(keys["server_public"], keys["allowed"])
    with pytest.raises(KeyFileError, match="does not exist"):
        load_client_keys(tmp_path / "nope", keys["server_public"])
    with pytest.raises(KeyFileError, match="holds no client public keys"):
        load_server_keys(keys["server_secret"], tmp_path)


def test_keys_generate_cli_and_half_configured_curve_is_refused(tmp_path, synth_lmdb):
    run = lambda *a: subprocess.run([sys.executable, "-m", "stoker.cli.main", *a], capture_output=True, text=True,
                                    timeout=60)
    out = run("keys", "generate", str(tmp_path / "k"), "--name", "hostA")
    assert out.returncode == 0 and (tmp_path / "k" / "hostA.key").exists()
    assert (tmp_path / "k" / "hostA.key_secret").stat().st_mode & 0o077 == 0
    half = run("produce", "--lmdb", str(synth_lmdb), "--curve-secret-key", str(tmp_path / "k" / "hostA.key_secret"))
    assert half.returncode == 2 and "go together" in half.stderr


# A trainer without keys races the producer in libzmq: whichever reads the other's greeting first
# reports the mechanism mismatch, the other a hang-up. Both producer warnings are acceptable there.
@pytest.mark.parametrize("trainer_keys, trainer_error, producer_warnings", [
    (None, "the producer requires CurveZMQ and this trainer has no keys",
     ("a trainer without CurveZMQ keys tried to connect", "a trainer hung up during the handshake")),
    ("stranger", "the producer refused this trainer's CurveZMQ key",
     ("refused a trainer at 127.0.0.1: its CurveZMQ public key",)),
    ("wrong_server", "not that producer's public key", ("it holds the wrong server key",)),
], ids=["no-keys", "unauthorised-key", "wrong-server-key"])
def test_a_failed_curve_handshake_is_named_in_the_error_the_stats_and_the_producer_log(
        synth_lmdb, keys, tmp_path, trainer_keys, trainer_error, producer_warnings):
    args = ["--workers", "1", "--batch-size", "4", "--image-size", "16",
            "--curve-secret-key", str(keys["server_secret"]), "--curve-authorized-keys", str(keys["allowed"])]
    curve = None
    if trainer_keys == "stranger":
        curve = load_client_keys(keys["stranger_secret"], keys["server_public"])
    elif trainer_keys == "wrong_server":
        other_server_public, _ = generate_keypair(tmp_path / "other", "other-producer")
        curve = load_client_keys(keys["client_secret"], other_server_public)
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        with ZMQInput([producer.endpoint], batch_size=4, image_shape=(16, 16, 3), recv_timeout=2, curve=curve) as inp:
            with pytest.raises(InputTimeoutError) as failure:
                inp.get()
            stats = inp.stats
        assert trainer_error in str(failure.value) and producer.endpoint in str(failure.value)
        assert "check the producers run" not in str(failure.value)
        assert stats.handshake_failures >= 1 and trainer_error in stats.last_handshake_error
        assert stats.batches == 0 and stats.connected_producers == 0
        log = wait_for_producer_log(producer, producer_warnings)
    for warning in producer_warnings:
        assert log.count(warning) <= 1, "the producer's warnings must be rate-limited"


@pytest.mark.parametrize("event, value, curve, says", [
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, False,
     "the producer requires CurveZMQ and this trainer has no keys"),
    # The same mistake when the producer hangs up before the trainer reads its greeting (a race in libzmq).
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, False, "the producer requires CurveZMQ and this trainer has no keys"),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, True,
     "this trainer uses CurveZMQ but the producer does not"),
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, True, "not that producer's public key"),
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, True, "copy this trainer's public key file"),
])
def test_every_handshake_failure_is_explained_with_a_fix(event, value, curve, says):
    from stoker.consumer.transport.connections import explain_handshake_failure

    assert says in explain_handshake_failure(event, value, curve)


@pytest.mark.parametrize("event, value, category, says", [
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, "mismatch", "without CurveZMQ keys"),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, "crypto", "wrong server key"),
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104, "hangup", "no CurveZMQ keys, or the wrong server key"),
])
def test_the_producer_names_each_handshake_failure_by_its_cause(event, value, category, says):
    from stoker.producer.serve.peer_security import classify_handshake_failure

    got_category, why = classify_handshake_failure(event, value, curve=True)
    assert got_category == category and says in why
