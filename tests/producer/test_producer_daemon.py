"""The producer daemon as users run it: a real subprocess, real sockets, real LMDB."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest
import zmq

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.producer.dataset.sources import LmdbDataset
from stoker.producer.process import ProducerProcess
from stoker.producer.measure.procfs import running
from stoker.protocol import decode_batch

from conftest import SYNTH_COUNT, expected_eval_image

pytestmark = pytest.mark.timeout(120)


def _receive_epochs(endpoints: list[str], epochs: int, timeout: float = 60.0) -> list:
    """Receive batches until every (producer, worker) stream has moved past ``epochs`` epochs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    for e in endpoints:
        sock.connect(e)
    batches, highest = [], {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            assert time.monotonic() < deadline, f"timed out; saw epochs {highest}"
            if not sock.poll(1000):
                continue
            batch = decode_batch(sock.recv_multipart(copy=False))
            batches.append(batch)
            stream = (batch.header.producer, batch.header.worker)
            highest[stream] = max(highest.get(stream, -1), int(batch["epoch"].min()))
            if len(highest) == expected_streams(endpoints) and min(highest.values()) >= epochs:
                return batches
    finally:
        sock.close(0)
        ctx.term()


def expected_streams(endpoints: list[str]) -> int:
    return len(endpoints) * 2  # every test here runs 2 workers per producer


def _samples(batches, epoch: int) -> Counter:
    seen = Counter()
    for b in batches:
        for index, e in zip(b["index"], b["epoch"]):
            if e == epoch:
                seen[int(index)] += 1
    return seen


def test_eval_mode_delivers_each_record_once_per_epoch_with_exact_images(synth_lmdb):
    size = 48
    args = ["--workers", "2", "--batch-size", "8", "--image-size", str(size), "--mode", "eval", "--seed", "3"]
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        batches = _receive_epochs([producer.endpoint], epochs=2)
    for epoch in (0, 1):
        seen = _samples(batches, epoch)
        assert set(seen) == set(range(SYNTH_COUNT)) and set(seen.values()) == {1}, f"epoch {epoch}"
    with LmdbDataset(synth_lmdb) as ds:
        for batch in batches[:4]:
            assert batch["images"].shape == (8, size, size, 3) and batch["images"].dtype == np.uint8
            assert batch["labels"].dtype == np.int32
            for image, label, index in zip(batch["images"], batch["labels"], batch["index"]):
                record = ds.read(int(index))
                true_label, data = record["label"], record["image"]
                assert label == true_label
                np.testing.assert_array_equal(image, expected_eval_image(data, size))


def test_two_shards_together_cover_every_record_exactly_once(synth_lmdb):
    args = ["--workers", "2", "--batch-size", "8", "--image-size", "32", "--mode", "eval", "--seed", "1"]
    with ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "0/2"]) as p0, \
            ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "1/2"]) as p1:
        batches = _receive_epochs([p0.endpoint, p1.endpoint], epochs=1)
    seen = _samples(batches, 0)
    assert set(seen) == set(range(SYNTH_COUNT)) and set(seen.values()) == {1}
    by_producer = {}
    for b in batches:
        by_producer.setdefault(b.header.producer, set()).update(int(i) for i in b["index"])
    shards = sorted(by_producer.values(), key=min)
    assert shards[0] == set(range(0, SYNTH_COUNT, 2)) and shards[1] == set(range(1, SYNTH_COUNT, 2))


def test_train_mode_is_reproducible_with_a_seed_and_varies_between_epochs(synth_lmdb):
    args = ["--workers", "1", "--batch-size", "16", "--image-size", "32", "--seed", "5"]
    runs = []
    for _ in range(2):
        with ProducerProcess(synth_lmdb, extra_args=args) as producer:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PULL)
            sock.connect(producer.endpoint)
            got = []
            for _ in range(2):
                assert sock.poll(30000)
                got.append(decode_batch(sock.recv_multipart()))
            sock.close(0)
            ctx.term()
        runs.append(got)
    np.testing.assert_array_equal(runs[0][0]["images"], runs[1][0]["images"])
    np.testing.assert_array_equal(runs[0][1]["index"], runs[1][1]["index"])
    assert not np.array_equal(runs[0][0]["index"], runs[0][1]["index"])


def test_corrupt_records_are_skipped_counted_and_logged_by_key(synth_lmdb, tmp_path):
    ds = tmp_path / "corrupt"
    shutil.copytree(synth_lmdb, ds)
    bad = {5: b"\xc1\xc1 not msgpack", 17: None, 40: "bad-image"}

    env = lmdb.open(str(ds), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for index, value in bad.items():
            key = b"%08d" % index
            if value is None:
                txn.delete(key)
            elif value == "bad-image":
                txn.put(key, msgpack.packb({"label": 1, "image": b"\xff\xd8\xffnot really a jpeg"}))
            else:
                txn.put(key, value)
    env.close()
    args = ["--workers", "2", "--batch-size", "8", "--image-size", "32", "--mode", "eval", "--seed", "2"]
    with ProducerProcess(ds, extra_args=args) as producer:
        batches = _receive_epochs([producer.endpoint], epochs=1)
        assert producer.proc.poll() is None, "daemon died of bad data"
        assert producer.stop() == 0
    seen = _samples(batches, 0)
    assert set(seen) == set(range(SYNTH_COUNT)) - set(bad)
    log = producer.log_text()
    for index in bad:
        assert f"skipping record {index:08d}" in log
    batches_sent, images_sent, skipped = producer.counters()
    assert skipped >= len(bad)


def test_decompression_bombs_in_any_format_are_skipped_and_counted_by_workers(synth_lmdb, tmp_path):
    """An LMDB written without the builder's checks: workers must refuse bombs from the header, every epoch."""
    from image_samples import FORMATS, bomb, real_png_bomb

    ds = tmp_path / "bombs"
    shutil.copytree(synth_lmdb, ds)
    bombs = {3 + 7 * i: bomb(fmt) for i, fmt in enumerate(FORMATS)}
    bombs[60] = real_png_bomb(10000)  # valid: an unchecked worker would decode 300 MB of it every epoch
    env = lmdb.open(str(ds), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for index, data in bombs.items():
            txn.put(b"%08d" % index, msgpack.packb({"label": 1, "image": data}))
    env.close()
    args = ["--workers", "2", "--batch-size", "8", "--image-size", "32", "--mode", "eval", "--seed", "2"]
    with ProducerProcess(ds, extra_args=args) as producer:
        batches = _receive_epochs([producer.endpoint], epochs=1)
        assert producer.stop() == 0
    assert set(_samples(batches, 0)) == set(range(SYNTH_COUNT)) - set(bombs)
    log = producer.log_text()
    for index in bombs:
        line = next(l for l in log.splitlines() if f"skipping record {index:08d}" in l)
        assert "pixels Stoker decodes" in line, line
    assert producer.counters()[2] >= len(bombs)


def _expected_eval_images(lmdb_path: Path, size: int) -> dict[int, np.ndarray]:
    """Record index -> its eval-mode image, computed independently of the producer."""
    with LmdbDataset(lmdb_path) as ds:
        return {i: expected_eval_image(ds.read(i)["image"], size) for i in range(len(ds))}


def _assert_exact_images(batch, expected: dict[int, np.ndarray]) -> int:
    """Every image equals its record's expected image; returns how many were checked."""
    for image, index in zip(batch["images"], batch["index"]):
        np.testing.assert_array_equal(image, expected[int(index)], err_msg=f"record {int(index)}")
    return len(batch["index"])


def test_a_slow_trainer_never_receives_a_batch_overwritten_while_in_flight(synth_lmdb):
    """Batches wait in the socket's queue while the trainer is slow: their shared slots must not be
    handed back to the worker (and overwritten) until ZMQ is done sending them."""
    size = 160  # 600 KB batches: more than the kernel's socket buffers hold, so sends stay queued
    expected = _expected_eval_images(synth_lmdb, size)
    args = ["--workers", "1", "--batch-size", "8", "--image-size", str(size), "--mode", "eval", "--seed", "6"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        sock.connect(producer.endpoint)
        try:
            for _ in range(12):
                time.sleep(0.25)  # the worker refills its free slots many times over meanwhile
                assert sock.poll(30000)
                _assert_exact_images(decode_batch(sock.recv_multipart(copy=False)), expected)
        finally:
            sock.close(0)
            ctx.term()


def _worker_pids(producer: ProducerProcess) -> list[int]:
    """The daemon's worker processes (not multiprocessing's resource tracker)."""
    pids = []
    for pid in producer.child_pids():
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


def test_killed_workers_are_replaced_and_no_batch_is_torn(synth_lmdb):
    """Workers write batches into shared slots the daemon sends from: a worker killed mid-batch,
    again and again, must never make a slot go out half-written or be reused while in flight."""
    size = 32
    expected = _expected_eval_images(synth_lmdb, size)
    args = ["--workers", "2", "--batch-size", "8", "--image-size", str(size), "--mode", "eval", "--seed", "4"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 2)
    checked = 0
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        sock.connect(producer.endpoint)
        try:
            for kill in range(6):
                for _ in range(10):
                    assert sock.poll(30000), f"no batch after kill {kill}:\n{producer.log_text()[-2000:]}"
                    checked += _assert_exact_images(decode_batch(sock.recv_multipart(copy=False)), expected)
                workers = _worker_pids(producer)
                assert len(workers) == 2, f"expected 2 workers, found {workers}"
                victim = workers[kill % 2]
                os.kill(victim, signal.SIGKILL)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:  # the daemon notices within 0.5 s and starts a new one
                    alive = [p for p in _worker_pids(producer) if p != victim and running(p)]
                    if len(alive) == 2:
                        break
                    time.sleep(0.05)
                else:
                    raise AssertionError(f"worker {victim} was not replaced:\n{producer.log_text()[-2000:]}")
            assert producer.proc.poll() is None
        finally:
            sock.close(0)
            ctx.term()
    assert checked == 6 * 10 * 8
    assert producer.log_text().count("restarting it") >= 6


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_daemon_and_every_worker_promptly(synth_lmdb, sig, tmp_path):
    # A temporary folder of its own: what other processes on this machine do to /tmp is no concern here.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    producer = ProducerProcess(synth_lmdb, extra_args=["--workers", "2", "--batch-size", "4", "--image-size", "32"],
                               log_path=tmp_path / "producer.log", env={**os.environ, "TMPDIR": str(private_tmp)})
    deadline = time.monotonic() + 20
    while len(producer.child_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = producer.child_pids()
    assert len(workers) >= 2
    time.sleep(1.0)  # let workers block on backpressure: nobody is receiving
    t0 = time.monotonic()
    producer.proc.send_signal(sig)
    # About 2 s on an idle machine; the bound here only tells a prompt stop from a hang (workers blocked on
    # backpressure would otherwise never exit), so a loaded CI machine cannot make it fail.
    producer.proc.wait(15)
    assert time.monotonic() - t0 < 15
    assert producer.proc.returncode == 0
    time.sleep(0.1)
    assert not [pid for pid in workers if running(pid)], "worker processes left behind"
    assert not list(private_tmp.iterdir()), "files left behind"
    producer.stop()


def test_a_killed_daemon_leaves_no_file_behind(synth_lmdb, tmp_path):
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    producer = ProducerProcess(synth_lmdb, extra_args=["--workers", "1", "--batch-size", "4", "--image-size", "32"],
                               log_path=tmp_path / "producer.log", env={**os.environ, "TMPDIR": str(private_tmp)})
    producer.kill()  # no chance to clean up
    assert not list(private_tmp.iterdir()), "a SIGKILLed producer left files behind"


def test_workers_die_with_a_killed_daemon(synth_lmdb):
    producer = ProducerProcess(synth_lmdb, extra_args=["--workers", "2", "--batch-size", "4", "--image-size", "32"])
    deadline = time.monotonic() + 20
    while len(producer.child_pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = producer.child_pids()
    producer.kill()
    deadline = time.monotonic() + 3
    while any(running(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if running(p)]


def test_backpressure_bounds_what_a_slow_trainer_makes_the_producer_hold(synth_lmdb):
    args = ["--workers", "2", "--batch-size", "4", "--image-size", "32", "--sndhwm", "2", "--log-interval", "0.5"]
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        time.sleep(3)  # nobody receives
        assert producer.stop() == 0
    batches_sent, _, _ = producer.counters()
    # Per hop: worker SNDHWM + proxy RCVHWM/SNDHWM, a few batches each; never the whole stream.
    assert batches_sent <= 16, f"{batches_sent} batches left the workers with no receiver"


def test_unusable_inputs_exit_2_with_a_message_not_a_traceback(synth_lmdb, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "stoker.cli.main", "produce", *args],
                              capture_output=True, text=True, timeout=60)

    missing = run("--lmdb", str(tmp_path / "missing"))
    assert missing.returncode == 2 and "no LMDB at" in missing.stderr and "Traceback" not in missing.stderr
    bad_shard = run("--lmdb", str(synth_lmdb), "--shard", "3/2")
    assert bad_shard.returncode == 2 and "shard 3/2 is invalid" in bad_shard.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = run("--lmdb", str(synth_lmdb), "--bind", f"tcp://127.0.0.1:{port}")
    assert in_use.returncode == 2 and f"cannot bind tcp://127.0.0.1:{port}" in in_use.stderr
    assert "Traceback" not in in_use.stderr


def test_a_launcher_killed_outright_leaves_no_producer_behind(synth_lmdb, tmp_path):
    # ProducerProcess passes --parent-pid: a test run or harness that is SIGKILLed (no stop(), no atexit) must not
    # leave daemons serving, and their workers, for ever.
    launcher_code = textwrap.dedent(f"""
        import time
        from stoker.producer.process import ProducerProcess
        producer = ProducerProcess({str(synth_lmdb)!r}, extra_args=["--workers", "2", "--batch-size", "4",
                                   "--image-size", "32"], log_path={str(tmp_path / "producer.log")!r})
        deadline = time.monotonic() + 20
        while len(producer.child_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        print(producer.pid, *producer.child_pids(), flush=True)
        time.sleep(3600)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) >= 3, pids  # the daemon, its two workers (and multiprocessing's resource tracker)
        assert all(running(p) for p in pids)
        launcher.kill()
        launcher.wait(10)
        # The daemon checks every 0.5 s and stops in a few; the bound only tells that from never.
        deadline = time.monotonic() + 60
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if running(p)], "processes left behind by a killed launcher"
        assert "is gone: shutting down" in (tmp_path / "producer.log").read_text()
    finally:
        launcher.kill()
        launcher.wait(10)
        for pid in pids:  # a failure must not leak what it checks for
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_pool_producers_on_one_host_and_port_number_get_their_own_ids_and_stats_entries(synth_lmdb):
    # Two pool producers on one host and one port number (two loopback addresses here; network namespaces,
    # containers with host networking or cloned VMs alike) are both HOST:PORT#auto: each instance adds its own id.
    args = ["--shard", "auto", "--workers", "1", "--batch-size", "8", "--image-size", "16"]
    producers = [ProducerProcess(synth_lmdb, extra_args=args)]
    port = producers[0].endpoint.rsplit(":", 1)[1]
    try:
        producers.append(ProducerProcess(synth_lmdb, bind=f"tcp://127.0.0.2:{port}", extra_args=args))
        ids = [p.producer_id for p in producers]
        shape = rf"{re.escape(socket.gethostname())}:{port}#auto~[0-9a-f]{{6}}"
        assert all(re.fullmatch(shape, i) for i in ids) and ids[0] != ids[1], ids
        with BatchStream([p.endpoint for p in producers], exact=True, recv_timeout=60) as stream:
            deadline = time.monotonic() + 60
            while len(stream.stats.per_producer) < 2:
                assert time.monotonic() < deadline, f"waited 60 s for both producers: {stream.stats.per_producer}"
                next(stream)
            stats = stream.stats
    finally:
        for p in producers:
            p.stop()
    assert sorted(stats.per_producer) == sorted(ids)
    assert all(stats.samples_per_producer[i] > 0 for i in ids)


def test_a_slot_is_held_by_its_large_arrays_alone_whatever_the_sockets_copy_threshold():
    """Arrays from the socket's copy threshold up go from the slot, tracked; smaller ones are copied as they are sent
    and hold no tracker. A threshold of 0 (pyzmq then sends every buffer without a copy) tracks them all."""
    import zmq

    from stoker.producer.serve.forwarder import slot_frames

    arrays = {"images": np.zeros(1 << 17, np.uint8), "labels": np.zeros(32, np.int32)}
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    try:
        frames, tracker = slot_frames(out, arrays, ["images", "labels"])
        assert isinstance(frames[0], zmq.Frame) and frames[0].tracker is not None
        assert frames[1] is arrays["labels"] and len(tracker.peers) == 1
        out.copy_threshold = 0
        frames, tracker = slot_frames(out, arrays, ["images", "labels"])
        assert all(isinstance(f, zmq.Frame) for f in frames) and len(tracker.peers) == 2
    finally:
        out.close(0)
        ctx.term()
