"""CurveZMQ: only a trainer holding an authorised key receives batches, and traffic is encrypted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from stoker.consumer import ZMQInput
from stoker.producer.process import ProducerProcess
from stoker.protocol.curve import KeyFileError, generate_keypair, load_client_keys, load_server_keys

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
