"""Jobs put together wrongly are named at once: exact vs plain modes, and producers whose shards overlap.

Real producer processes, real sockets, real TensorFlow. Each misconfiguration is one that waiting
cannot fix, so the trainer must say so well before its ``recv_timeout`` (set far beyond the test's
own timeout, so a fall-back to the timeout fails the test instead of passing slowly).
"""

from __future__ import annotations

import pytest

from stoker.consumer import InputError, InputTimeoutError, ZMQInput
from stoker.producer.process import ProducerProcess

pytestmark = pytest.mark.timeout(150)

BATCH, SIZE = 8, 32
NEVER = 3600.0  # recv_timeout: the test's own timeout ends first if the trainer waits for it


def _producer(lmdb, *extra):
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", str(SIZE), *extra]
    return ProducerProcess(lmdb, extra_args=args)


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_a_plain_trainer_facing_exact_producers_fails_at_once_saying_so(synth_lmdb, receive):
    with _producer(synth_lmdb, "--exact") as producer:
        with ZMQInput([producer.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=NEVER,
                      receive=receive) as inp:
            with pytest.raises(InputError) as failure:
                inp.get()
            stats = inp.stats
    assert not isinstance(failure.value, InputTimeoutError)
    assert "refused the connection 3 times in a row" in str(failure.value)
    assert "exact mode" in str(failure.value) and producer.endpoint in str(failure.value)
    assert stats.batches == 0 and stats.handshake_failures >= 1


def test_an_exact_trainer_facing_plain_producers_fails_at_once_saying_so(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        with pytest.raises(InputError) as failure:  # waiting for the producers to describe their batches
            ZMQInput([producer.endpoint], exact=True, recv_timeout=NEVER)
    assert not isinstance(failure.value, InputTimeoutError)
    assert "refused the connection 3 times in a row" in str(failure.value) and "exact mode" in str(failure.value)


def _until_both_sent(inp, producers: int = 2, steps: int = 200) -> None:
    """Take batches until every producer's batches arrived (bounded by steps, not by time)."""
    for _ in range(steps):
        inp.get()
        if len(inp.stats.per_producer) >= producers:
            return
    raise AssertionError(f"only {inp.stats.per_producer} sent within {steps} steps")


def test_producers_whose_shards_disagree_are_named_once_and_counted(synth_lmdb, caplog):
    with _producer(synth_lmdb, "--seed", "1") as whole, _producer(synth_lmdb, "--shard", "1/2", "--seed", "1") as half, \
            ZMQInput([whole.endpoint, half.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3),
                     recv_timeout=60) as inp:
        _until_both_sent(inp)
        for _ in range(10):  # more batches from both: still one conflict, one warning
            inp.get()
        stats = inp.stats
    assert stats.shard_conflicts == 1
    assert "0/1" in stats.last_shard_conflict and "1/2" in stats.last_shard_conflict
    assert "shard counts disagree" in stats.last_shard_conflict and "--shard 0/N" in stats.last_shard_conflict
    assert sorted(stream.split(":")[0] for stream in stats.producer_streams.values()) == ["0/1", "1/2"]
    assert sum("shard counts disagree" in r.getMessage() for r in caplog.records) == 1


def test_two_producers_serving_the_same_shard_with_the_same_seed_are_named(synth_lmdb):
    with _producer(synth_lmdb, "--shard", "0/2", "--seed", "3") as a, \
            _producer(synth_lmdb, "--shard", "0/2", "--seed", "3") as b, \
            ZMQInput([a.endpoint, b.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=60) as inp:
        _until_both_sent(inp)
        stats = inp.stats
    assert stats.shard_conflicts == 1 and "both serve shard 0/2 with seed 3" in stats.last_shard_conflict


def test_distinct_shards_and_distinct_seeds_are_not_a_conflict(synth_lmdb):
    with _producer(synth_lmdb, "--shard", "0/2", "--seed", "1") as a, \
            _producer(synth_lmdb, "--shard", "1/2", "--seed", "1") as b, \
            ZMQInput([a.endpoint, b.endpoint], batch_size=BATCH, image_shape=(SIZE, SIZE, 3), recv_timeout=60) as inp:
        _until_both_sent(inp)
        stats = inp.stats
    assert stats.shard_conflicts == 0 and len(stats.producer_streams) == 2


def test_exact_mode_refuses_producers_whose_shards_overlap(synth_lmdb):
    with _producer(synth_lmdb, "--exact", "--seed", "1") as whole, \
            _producer(synth_lmdb, "--exact", "--shard", "1/2", "--seed", "1") as half, \
            ZMQInput([whole.endpoint, half.endpoint], exact=True, recv_timeout=60) as inp:
        with pytest.raises(InputError, match="exact mode cannot hold every record once per epoch.*shard counts "
                                             "disagree"):
            for _ in range(400):  # until both producers' batches arrived; bounded by steps
                inp.get()
