"""Finding producers: names re-resolved, a user's discovery function, and a plain-mode pool that grows and shrinks."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.transport.discovery import NameNotFound, ProducerPool, is_literal
from stoker.producer.process import ProducerProcess
from stoker.producer.dataset.build.synthetic import build_synthetic


def test_ip_addresses_and_ipc_stand_as_given_and_names_are_resolved_by_the_system():
    assert is_literal("tcp://10.0.0.5:5555") and is_literal("ipc:///tmp/x") and is_literal("tcp://[::1]:5")
    assert not is_literal("tcp://stoker-producer.ml.svc:5555")
    pool = ProducerPool("tcp://localhost:5555,tcp://10.1.2.3:7", refresh_s=0)
    assert pool.endpoints == ["tcp://127.0.0.1:5555", "tcp://10.1.2.3:7"]  # IPv4 only where a name has it
    assert not pool.dynamic and ProducerPool("tcp://localhost:1", background=False).dynamic


def test_a_pool_follows_what_a_name_resolves_to_and_survives_failed_lookups():
    answers: list = [["10.0.0.1", "10.0.0.2"]]

    def lookup(host: str, port: int) -> list[str]:
        answer = answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    pool = ProducerPool("tcp://stoker-producer.ns.svc:5555", refresh_s=0.01, lookup=lookup, background=False)
    assert pool.endpoints == ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]
    answers[0] = ["10.0.0.2", "10.0.0.3"]
    time.sleep(0.02)
    assert pool.refresh() == (["tcp://10.0.0.3:5555"], ["tcp://10.0.0.1:5555"])
    answers[0] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")  # DNS down: the pool stays
    time.sleep(0.02)
    assert pool.refresh() == ([], []) and len(pool.endpoints) == 2
    answers[0] = NameNotFound("stoker-producer.ns.svc")  # scaled to zero: NXDOMAIN
    time.sleep(0.02)
    assert pool.refresh() == ([], ["tcp://10.0.0.2:5555", "tcp://10.0.0.3:5555"]) and pool.endpoints == []


def test_a_discovery_function_that_raises_keeps_the_pool_and_bad_sources_are_refused_with_the_fix():
    calls = {"n": 0}

    def discover() -> list[str]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("consul is down")
        return ["tcp://10.0.0.9:1"]

    pool = ProducerPool(discover, refresh_s=0.01, background=False)
    time.sleep(0.02)
    assert pool.refresh() == ([], []) and pool.endpoints == ["tcp://10.0.0.9:1"]
    for bad in ("", [], ["datahost:5555"], ["tcp://datahost"]):
        with pytest.raises(ValueError, match="tcp://"):
            ProducerPool(bad)


@pytest.fixture(scope="module")
def plain_lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pool") / "data"
    build_synthetic(path, 64, seed=2, progress=False)
    return path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("receive", ["direct", "libzmq"])
def test_a_plain_trainer_takes_a_joining_producer_and_keeps_going_when_one_leaves(plain_lmdb: Path, receive: str):
    args = ["--workers", "1", "--batch-size", "4", "--image-size", "16"]
    first = ProducerProcess(plain_lmdb, extra_args=[*args, "--shard", "0/2", "--seed", "1"])
    pool = [first.endpoint]
    second = None
    try:
        with BatchStream(lambda: list(pool), recv_timeout=60, discover_every=0.1, receive=receive,
                         queue_capacity=2) as stream:
            next(stream)
            second = ProducerProcess(plain_lmdb, extra_args=[*args, "--shard", "1/2", "--seed", "1"])
            pool.append(second.endpoint)
            deadline = time.monotonic() + 60
            while len(stream.stats.per_producer) < 2:  # the joining producer's batches arrive, bounded
                assert time.monotonic() < deadline, f"the joining producer never delivered: {stream.stats}"
                next(stream)
            assert stream.stats.producers_joined == 2  # the first one included (issue 39.12)
            pool.remove(first.endpoint)  # scaled down: it leaves the pool, then stops
            time.sleep(0.3)
            first.stop()
            for _ in range(20):  # the trainer goes on with the other, never waiting on the one that left
                next(stream)
            stats = stream.stats
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert stats.producers_left == 1 and stats.pool_size == 1 and stats.connected_producers == 1
    # Plain producers count their own shard's epochs: coverage is per shard, 32 records each.
    assert {shard for shard, _ in stats.coverage} == {"0/2", "1/2"}, stats.coverage
    assert all(0 < seen <= 32 and records == 32 for seen, records in stats.coverage.values()), stats.coverage


def test_a_slow_lookup_never_blocks_the_caller():
    """Resolution runs on the pool's thread: refresh() answers at once with what the last lookup found."""
    import threading

    release = threading.Event()
    calls = {"n": 0}

    def lookup(host: str, port: int) -> list[str]:
        calls["n"] += 1
        if calls["n"] > 1:
            release.wait(30)  # a DNS server that does not answer
            return ["10.0.0.7"]
        return ["10.0.0.1"]

    pool = ProducerPool("tcp://slow.example:1", refresh_s=0.01, lookup=lookup)
    try:
        while calls["n"] < 2:  # the thread is inside the slow lookup
            time.sleep(0.01)
        assert pool.refresh() == ([], []) and pool.endpoints == ["tcp://10.0.0.1:1"]
        release.set()
        deadline = time.monotonic() + 30
        while pool.endpoints != ["tcp://10.0.0.7:1"]:
            assert time.monotonic() < deadline
            pool.refresh()
            time.sleep(0.01)
    finally:
        release.set()
        pool.close()
    assert not any(t.name == "stoker-discovery" for t in threading.enumerate()), "close() left the thread running"
