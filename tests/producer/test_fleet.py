"""A producer fleet (producer/fleet/): many endpoints of the daemon's real serving code in a few processes, read by
one real trainer over real sockets (issue 41: a thousand producers on one machine)."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from stoker.consumer import BatchStream
from stoker.consumer.transport.connection_loop import MAX_THREADS
from stoker.consumer.exact.state import parse_state
from stoker.producer.fleet.fleet import FleetConfig
from stoker.producer.fleet.launcher import FleetProcesses
from stoker.producer.fleet.synthetic_worker import expected_pixels

from conftest import assert_exactly_once

ENDPOINTS, PROCESSES, RECORDS, BATCH = 64, 2, 64, 8


def _receive_threads() -> int:
    return sum(t.name.startswith("stoker-receive-") for t in threading.enumerate())


def test_a_trainer_reading_a_fleet_of_64_endpoints_gets_each_records_batch_once_from_every_endpoint():
    with FleetProcesses(ENDPOINTS, PROCESSES, ["--records", str(RECORDS), "--batch-size", str(BATCH)]) as fleet:
        assert len(set(fleet.addresses)) == ENDPOINTS
        assert sorted(line["shard"] for line in fleet.serving) == sorted(f"{i}/{ENDPOINTS}" for i in range(ENDPOINTS))
        rows: Counter = Counter()
        batches: Counter = Counter()
        most_threads = 0
        with BatchStream(fleet.addresses, recv_timeout=60) as stream:
            taken = 0
            # Until the batches taken (not only those queued, which per_producer counts) came from every endpoint.
            while len({index % ENDPOINTS for _, index in rows}) < ENDPOINTS or taken < 2 * ENDPOINTS:
                batch = next(stream)
                taken += 1
                assert (batch["images"] == expected_pixels(batch["index"])[:, None, None, None]).all()
                assert (batch["labels"] == batch["index"] % 10).all()
                # A batch is named by its first record (one endpoint's batches cut its stream in order).
                batches[(int(batch["epoch"][0]), int(batch["index"][0]))] += 1
                rows.update(zip(batch["epoch"].tolist(), batch["index"].tolist()))
                most_threads = max(most_threads, _receive_threads())
            per_producer = dict(stream.stats.per_producer)
        fleet.stop()
        made = sum(line["batches"] for line in fleet.stopped())
    assert len(per_producer) == ENDPOINTS  # every endpoint delivered
    assert max(batches.values()) == 1 and max(rows.values()) == 1  # nothing arrived twice
    # Each endpoint's records are its shard's (index % 64 == shard): the endpoints' streams are disjoint and whole.
    shards_seen = {index % ENDPOINTS for _, index in rows}
    assert shards_seen == set(range(ENDPOINTS))
    assert len(rows) == taken * BATCH <= made * BATCH
    assert 1 <= most_threads <= MAX_THREADS == 8, most_threads


def test_an_exact_fleet_of_64_fixed_shards_serves_one_epoch_each_record_exactly_once():
    flags = ["--records", str(RECORDS), "--batch-size", str(BATCH), "--exact", "--epochs", "1"]
    with FleetProcesses(ENDPOINTS, PROCESSES, flags) as fleet:
        assert {line["mode"] for line in fleet.serving} == {"exact"}
        rows = []
        with BatchStream(fleet.addresses, exact=True, recv_timeout=60) as stream:
            for batch in stream:  # ends when every producer said its epochs are consumed
                assert (batch["images"] == expected_pixels(batch["index"])[:, None, None, None]).all()
                rows.extend(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            assert len(stream.stats.per_producer) == ENDPOINTS
    assert_exactly_once(rows, set(range(ENDPOINTS * RECORDS)))


def test_a_fleet_refuses_endpoints_outside_it_and_a_launcher_names_a_process_that_failed():
    with pytest.raises(ValueError, match="not within a fleet of 4"):
        FleetConfig(first=3, count=2, of=4)
    with pytest.raises(RuntimeError, match="records, batch size"):
        FleetProcesses(2, 1, ["--records", "0"])


@pytest.mark.parametrize("order", [1, 2])
def test_a_pool_fleet_of_16_endpoints_serves_one_trainer_one_epoch_each_record_exactly_once(order):
    flags = ["--records", str(RECORDS), "--batch-size", str(BATCH), "--pool", "--epoch-order", str(order),
             "--epochs", "1"]
    with FleetProcesses(16, PROCESSES, flags) as fleet:
        assert {line["mode"] for line in fleet.serving} == {"pool"}
        assert {line["shard"] for line in fleet.serving} == {"auto"}
        rows = []
        with BatchStream(fleet.addresses, exact=True, recv_timeout=60) as stream:
            for batch in stream:  # ends when the trainer's splits of the one epoch are all consumed
                assert (batch["images"] == expected_pixels(batch["index"])[:, None, None, None]).all()
                rows.extend(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            keys = list(parse_state(stream.save_state()).state.streams)
    assert len(keys) == 1 and keys[0].startswith("splits:") and keys[0].endswith(":o2") == (order == 2), keys
    assert_exactly_once(rows, set(range(16 * RECORDS)))
