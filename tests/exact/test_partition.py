"""A partitioned topology (consumer/exact/pool/partition.py): each trainer of a job reads k of the pool's N producers,
and every record is still served once per epoch across the job (issue 41)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings, strategies as st

from stoker.consumer import BatchStream
from stoker.consumer.exact.pool.partition import partition, readers
from stoker.consumer.input_setup import InputOptions
from stoker.producer.fleet.launcher import FleetProcesses
from stoker.producer.fleet.synthetic_worker import expected_pixels

from conftest import assert_exactly_once

ENDPOINTS, TRAINERS, RECORDS, BATCH = 16, 4, 48, 8


@st.composite
def _layouts(draw):
    producers = draw(st.integers(1, 64))
    world = draw(st.integers(1, 32))
    per_trainer = draw(st.integers(-(-producers // world), producers))
    return producers, world, per_trainer


@settings(max_examples=200, deadline=None)
@given(_layouts())
def test_each_trainer_reads_k_distinct_producers_and_each_producer_is_read_by_about_k_w_over_n(layout):
    producers, world, k = layout
    names = [f"tcp://h{i % 3}:{5000 + i}" for i in range(producers)]
    for rank in range(world):
        mine = partition(names, rank, world, per_trainer=k)
        assert len(mine) == len(set(mine)) == k and set(mine) <= set(names)
    counts = readers(producers, world, k)
    assert min(counts) >= 1
    assert set(counts) <= {k * world // producers, -(-k * world // producers)}
    assert sum(counts) == k * world


def test_a_partition_that_cannot_hold_is_refused_by_name():
    names = [f"tcp://h:{5000 + i}" for i in range(8)]
    with pytest.raises(ValueError, match="leaving 4 unread: give at least 4"):
        partition(names, 0, 2, per_trainer=2)
    with pytest.raises(ValueError, match="producers_per_trainer=0: give 1 to 8"):
        partition(names, 0, 8, per_trainer=0)
    with pytest.raises(ValueError, match="producers_per_trainer=9: give 1 to 8"):
        partition(names, 0, 8, per_trainer=9)
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        partition(names, 2, 2, per_trainer=4)
    with pytest.raises(ValueError, match="given twice: tcp://h:5000"):
        partition(names + names[:1], 0, 1, per_trainer=9)
    with pytest.raises(ValueError, match="no producer addresses"):
        partition([], 0, 1, per_trainer=1)
    assert partition(names, 1, 2, per_trainer=5) == names[5:] + names[:2]  # wraps round: producers 5..7, 0, 1


def test_the_facades_option_reads_the_partition_and_refuses_what_cannot_hold():
    names = [f"tcp://h:{5000 + i}" for i in range(8)]
    options = InputOptions(names, exact=True, share=(1, 4), producers_per_trainer=3)
    assert options.receive_options().addresses == partition(names, 1, 4, per_trainer=3) == names[3:6]
    assert InputOptions(names, exact=True, share=(1, 4)).receive_options().addresses == names  # default: all
    with pytest.raises(ValueError, match="leaving 4 unread"):
        InputOptions(names, exact=True, share=(0, 2), producers_per_trainer=2).receive_options()
    with pytest.raises(ValueError, match="partitions a list of addresses"):
        InputOptions(lambda: names, exact=True, share=(0, 2), producers_per_trainer=4).receive_options()


def _trainer(addresses: list[str], rank: int, per_trainer: int, rows: list, seen: set, errors: list) -> None:
    try:
        with BatchStream(addresses, exact=True, share=(rank, TRAINERS), producers_per_trainer=per_trainer,
                         recv_timeout=60) as stream:
            for batch in stream:  # ends when this trainer's share of the epoch is all consumed
                assert (batch["images"] == expected_pixels(batch["index"])[:, None, None, None]).all()
                rows.extend(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            seen.update(stream.stats.per_producer)
    except BaseException as exc:  # raised again by the test, not lost with the thread
        errors.append(exc)


@pytest.mark.parametrize("order, per_trainer", [(2, 4), (1, 4), (2, 6)])
def test_four_trainers_each_reading_k_of_16_pool_producers_get_every_record_once_across_the_job(order, per_trainer):
    """Real BatchStreams (one per trainer, each in its own thread, each its own sockets) of one job (share r/4),
    each given every address and ``producers_per_trainer=k``, so connected to its partition only. k=4: the partitions are disjoint; k=6: some producers serve two
    trainers, each its own splits."""
    flags = ["--records", str(RECORDS), "--batch-size", str(BATCH), "--pool", "--epoch-order", str(order),
             "--epochs", "1"]
    with FleetProcesses(ENDPOINTS, 2, flags) as fleet:
        producer_of = {line["endpoint"]: line["producer_id"] for line in fleet.serving}
        reads = [partition(fleet.addresses, rank, TRAINERS, per_trainer) for rank in range(TRAINERS)]
        rows: list[list] = [[] for _ in range(TRAINERS)]
        seen: list[set] = [set() for _ in range(TRAINERS)]
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_trainer,
                                    args=(fleet.addresses, r, per_trainer, rows[r], seen[r], errors))
                   for r in range(TRAINERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a trainer did not end within 120 s"
    if errors:
        raise errors[0]
    for rank in range(TRAINERS):
        assert rows[rank], f"trainer {rank} consumed nothing"
        # Its batches came only from the producers it reads: the pool handed its splits to no other.
        assert seen[rank] <= {producer_of[a] for a in reads[rank]}, rank
    assert_exactly_once([row for mine in rows for row in mine], set(range(ENDPOINTS * RECORDS)))
