"""A producer on the trainer's host (``local_producer=``): started by the input, one more in the pool, niced and
pinned, stopped with the input; killed, the input goes on with the remote producer and counts the death."""

from __future__ import annotations

import logging
import os
import re
import signal
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import SYNTH_COUNT, assert_exactly_once, count_rows, one_worker_producer
from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.placement.local_process import LocalProducerError
from stoker.consumer.placement.local_producer import LocalProducer, parse_cpus
from stoker.producer.measure.procfs import running, stat_fields

BATCH, SIZE = 4, 32
FLAGS = ["--batch-size", str(BATCH), "--image-size", str(SIZE)]
#: batches an input may take before the one it waits for must have come (a bound, never a timing)
MAX_BATCHES = 400


@pytest.fixture(scope="module")
def remote(synth_lmdb: Path):
    with one_worker_producer(synth_lmdb, batch=BATCH, size=SIZE) as producer:
        yield producer


def _local(synth_lmdb: Path, **fields) -> LocalProducer:
    return LocalProducer(str(synth_lmdb), workers=1, extra_flags=FLAGS, **fields)


@contextmanager
def paused(producer):
    """The remote producer silent (SIGSTOP) while the block runs: the local one is then the only one sending."""
    producer.pause()
    try:
        yield
    finally:
        producer.resume()


def _take_until(stream: BatchStream, done) -> None:
    """Take batches until ``done(stats)`` holds; fails after ``MAX_BATCHES``."""
    for _ in range(MAX_BATCHES):
        next(stream)
        if done(stream.stats):
            return
    pytest.fail(f"not seen in {MAX_BATCHES} batches: {stream.stats.per_producer}")


def _children(pid: int) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _parent(int(e.name)) == pid]


def _parent(pid: int) -> int:
    try:
        return int(stat_fields(pid)[1])
    except OSError:
        return -1


def test_a_local_producer_serves_the_input_niced_and_pinned_and_goes_with_it(synth_lmdb, remote):
    core = (os.cpu_count() or 1) - 1
    with BatchStream([remote.endpoint], local_producer=_local(synth_lmdb, cpus=[core])) as stream:
        local = stream.local_producer
        assert local.producer_id.startswith("local-") and local.address.startswith("ipc://")
        assert stream.receive == "direct"  # its Unix socket and the remote's TCP, read alike
        with paused(remote):
            _take_until(stream, lambda s: local.producer_id in s.per_producer)
        _take_until(stream, lambda s: remote.producer_id in s.per_producer)
        assert int(stat_fields(local.pid)[16]) == 10  # nice: below the training step
        assert os.sched_getaffinity(local.pid) == {core}
        workers = _children(local.pid)
        assert workers and all(os.sched_getaffinity(w) == {core} for w in workers)  # inherited
        pids = [local.pid, *workers]
    assert not [p for p in pids if running(p)], "the local producer or a worker of it outlived close()"
    assert stream.stats.local_producer_deaths == 0
    assert not Path(local.address[len("ipc://"):]).parent.exists()  # its folder (socket, log) removed


def test_a_killed_local_producer_leaves_the_input_on_the_remote_and_is_counted(synth_lmdb, remote, caplog):
    caplog.set_level(logging.WARNING, "stoker.consumer")
    with BatchStream([remote.endpoint], local_producer=_local(synth_lmdb)) as stream:
        local = stream.local_producer
        with paused(remote):
            _take_until(stream, lambda s: local.producer_id in s.per_producer)
        os.killpg(local.pid, signal.SIGKILL)  # the producer and its workers, as a crash of them would
        assert local.wait_exit(30) == -signal.SIGKILL
        assert stream.stats.local_producer_deaths == 1
        from stoker.consumer.receive.metrics import InputCollector  # where the user looks: Prometheus

        deaths = {f.name: f for f in InputCollector(stream).collect()}["stoker_trainer_local_producer_deaths"]
        assert deaths.samples[0].value == 1
        after = stream.stats.per_producer[remote.producer_id]
        _take_until(stream, lambda s: s.per_producer[remote.producer_id] >= after + 3)
        assert not local.running and stream.error is None
    assert stream.stats.local_producer_deaths == 1
    assert any(local.producer_id in r.getMessage() and "died" in r.getMessage() for r in caplog.records)


def test_a_local_producer_joins_an_elastic_pool_each_record_once(synth_lmdb):
    pool = [*FLAGS, "--shard", "auto", "--seed", "3", "--epochs", "1"]
    seen: Counter = Counter()
    with one_worker_producer(synth_lmdb, batch=BATCH, size=SIZE, flags=pool[len(FLAGS):]) as remote, \
            BatchStream([remote.endpoint], exact=True, batch_size=BATCH, image_shape=(SIZE, SIZE, 3),
                        local_producer=LocalProducer(str(synth_lmdb), extra_flags=pool)) as stream:
        local = stream.local_producer.producer_id
        with paused(remote):  # the local producer takes splits of the epoch first
            while local not in stream.stats.per_producer:
                count_rows(next(stream), seen)
        for batch in stream:
            count_rows(batch, seen)
    assert_exactly_once(seen, set(range(SYNTH_COUNT)))


def test_a_local_producer_that_cannot_start_is_named_with_its_log(tmp_path):
    with pytest.raises(LocalProducerError, match="exited") as caught:
        BatchStream([], local_producer=LocalProducer(str(tmp_path / "missing"), extra_flags=FLAGS))
    message = str(caught.value)
    assert "missing" in message.split("its log ends:")[1]  # the producer's own words on what was wrong
    socket_path = Path(re.search(r"ipc://(\S+)", message).group(1))
    assert not socket_path.parent.exists()  # its folder (log, socket) removed


@pytest.mark.parametrize("fields, error", [
    ({"extra_flags": ["--bind", "tcp://*:1"]}, "set by the launcher"),
    ({"extra_flags": ["--workers=3"]}, "set by the launcher"),
    ({"workers": 0}, "workers=0"),
    ({"nice": 20}, "nice=20"),
    ({"cpus": [10 ** 6]}, "CPU numbers"),
])
def test_bad_local_producer_settings_are_refused_naming_the_fix(fields, error):
    with pytest.raises(ValueError, match=error):
        LocalProducer("data", **fields)


@pytest.mark.parametrize("kwargs, flags, error", [
    ({"exact": True}, [], "plain producer"),
    ({}, ["--exact"], "exact-mode producer"),
])
def test_a_local_producer_that_cannot_serve_the_input_is_refused_before_it_starts(kwargs, flags, error):
    with pytest.raises(ValueError, match=error):
        BatchStream(["tcp://127.0.0.1:1"], local_producer=LocalProducer("data", extra_flags=flags), **kwargs)


def test_cpu_lists_parse_and_bound():
    assert parse_cpus("0,2-3") == (0, 2, 3) and parse_cpus("1") == (1,)
    for text in ("", "a", "3-1", "-1", "0-99999999"):
        with pytest.raises(ValueError, match="CPU"):
            parse_cpus(text)
