"""``stoker produce --status-file``: the launch channel for programs, read from real daemons over real sockets.

Launchers (``ProducerProcess``: tests, the demo, ``stoker cluster``, benchmarks) learn the bound endpoint and
the stop summary from it, never from the log's wording. Every wait here is bounded; nothing is timed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from stoker.cli.command_lines import produce_command, produce_flags, train_command
from stoker.producer.process import ProducerProcess, ProducerStartError
from stoker.protocol import decode_batch

pytestmark = pytest.mark.timeout(120)

BATCH = 4
FLAGS = produce_flags(workers=1, batch_size=BATCH, image_size=32, mode="eval", shard="0/1", seed=3)


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), text  # only whole lines, each one write
    return [json.loads(line) for line in text.splitlines()]


def _wait_for_serving(path: Path, proc: subprocess.Popen, log: Path) -> dict:
    """The first line ``proc`` wrote (bounded wait; a leftover line of another process does not count)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            ours = [line for line in _lines(path) if line.get("pid") == proc.pid]
            if ours:
                return ours[0]
        assert proc.poll() is None, f"the daemon exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no status line within 60 s:\n{log.read_text()[-3000:]}")


def test_status_file_carries_the_bound_endpoint_and_the_stop_summary(synth_lmdb, tmp_path):
    status, log = tmp_path / "status.jsonl", tmp_path / "producer.log"
    status.write_text('{"event": "serving", "endpoint": "tcp://stale:1", "pid": 1}\n')  # an earlier run's: truncated
    with open(log, "wb") as log_file:
        argv = produce_command(synth_lmdb, "tcp://127.0.0.1:*", [*FLAGS, *produce_flags(status_file=status)])
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    received = []
    try:
        serving = _wait_for_serving(status, proc, log)
        assert serving["event"] == "serving" and serving["pid"] == proc.pid
        assert serving["endpoint"].startswith("tcp://127.0.0.1:") and not serving["endpoint"].endswith(":*")
        assert serving["mode"] == "plain" and serving["shard"] == "0/1" and serving["seed"] == 3
        assert serving["epochs"] is None and serving["workers"] == 1 and serving["metrics_port"] is None
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        try:
            sock.connect(serving["endpoint"])  # the real port: the batches come from this very daemon
            while len(received) < 3:
                assert sock.poll(30000), f"no batch from {serving['endpoint']}:\n{log.read_text()[-3000:]}"
                received.append(decode_batch(sock.recv_multipart(copy=False)))
        finally:
            sock.close(0)
            ctx.term()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert {b.header.producer for b in received} == {serving["producer_id"]}
    first, stopped = _lines(status)
    assert first == serving and stopped["event"] == "stopped" and stopped["pid"] == proc.pid
    assert stopped["batches"] >= len(received) and stopped["images"] == BATCH * stopped["batches"]
    assert stopped["skipped"] == 0


def test_producer_process_reads_the_status_file_whatever_the_log_looks_like(synth_lmdb):
    # JSON log lines: the launcher does not depend on the log's format or wording.
    with ProducerProcess(synth_lmdb, extra_args=[*FLAGS, "--log-format", "json"]) as producer:
        assert producer.endpoint == producer.serving["endpoint"] and producer.endpoint.startswith("tcp://127.0.0.1:")
        assert producer.producer_id == producer.serving["producer_id"] and producer.serving["pid"] == producer.pid
        assert producer.counters() is None  # still serving
        # Unlinked once both ends hold it open: a launcher killed outright leaves no folder behind.
        assert not producer.status.path.parent.exists()
    assert producer.proc.returncode == 0
    batches, images, skipped = producer.counters()  # read through the launcher's open file
    assert images == BATCH * batches and skipped == 0


@pytest.mark.parametrize("flags, mode, epochs", [
    (["--exact", "--epochs", "2"], "exact", 2),
    (["--shard", "auto"], "pool", None),
], ids=["exact", "pool"])
def test_the_serving_line_says_the_serving_mode(synth_lmdb, flags, mode, epochs):
    with ProducerProcess(synth_lmdb, extra_args=[*FLAGS, *flags]) as producer:
        assert (producer.serving["mode"], producer.serving["epochs"]) == (mode, epochs)
        assert producer.serving["shard"] == ("auto" if mode == "pool" else "0/1")
    assert producer.counters() is not None


def test_a_daemon_that_dies_before_binding_is_reported_with_its_log_tail(tmp_path):
    with pytest.raises(ProducerStartError, match="no LMDB at") as failed:
        ProducerProcess(tmp_path / "missing", extra_args=FLAGS, start_timeout=60)
    assert "did not start (exit 2)" in str(failed.value)


def test_launch_command_lines_hold_the_typed_flags():
    assert produce_flags(workers=2, shard="auto", epochs=None, producer_id="h#auto") == \
        ["--workers", "2", "--shard", "auto", "--id", "h#auto"]
    assert produce_command("/data", "tcp://*:5555", ["--seed", "1"]) == \
        [sys.executable, "-m", "stoker.cli.main", "produce", "--lmdb", "/data", "--bind", "tcp://*:5555", "--seed", "1"]
    argv = train_command(["tcp://a:1", "tcp://b:2"], model="small-cnn", steps=5, batch_size=8, image_size=32,
                         classes=4, exact=True, trainer_id="t0", share=(1, 2), discover_every=1.0, no_progress=True)
    assert argv[argv.index("--connect") + 1] == "tcp://a:1,tcp://b:2"
    assert argv[argv.index("--share") + 1] == "1/2" and argv[argv.index("--discover-every") + 1] == "1"
    assert {"--exact", "--no-progress"} <= set(argv) and "--queue-capacity" not in argv
    # Every flag built here is one `stoker train` / `stoker produce` accept.
    from stoker.cli.main import build_parser

    build_parser().parse_args(argv[3:])
    build_parser().parse_args(produce_command("/data", "tcp://*:5555", FLAGS)[3:])
