"""The estimate on a real input: real producers, real sockets, a trainer loop that takes batches.

Values depend on this machine's speed, so only what holds at any speed is asserted: the reading comes, its parts
agree with the formula, the iterable facade timed its own waits, and Prometheus exports the same numbers."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stoker.consumer import BatchStream
from stoker.consumer.sizing import DESIRED_PRODUCERS_METRIC, PRODUCERS_NEEDED_METRIC

from conftest import one_worker_producer, stoker_cli

pytestmark = pytest.mark.timeout(120)


def test_a_batch_stream_reads_its_demand_and_its_producers_capacity_and_exports_the_need(synth_lmdb):
    with one_worker_producer(synth_lmdb, batch=8, size=32) as producer, \
            BatchStream([producer.endpoint], batch_size=8, image_shape=(32, 32, 3), recv_timeout=30) as stream:
        port = stream.serve_metrics(0)
        batches = iter(stream)
        deadline = time.monotonic() + 90
        while stream.sizing.producers_needed is None:  # a window of consumption, then the sampler's update
            assert time.monotonic() < deadline, f"no reading: {stream.sizing.why}"
            next(batches)
            time.sleep(0.01)  # the step
        sizing = stream.sizing
        d, s = sizing.demand, sizing.supply
        assert d is not None and s is not None and d.wait_timed and s.producers == 1
        assert d.images_per_s >= d.consumed_images_per_s > 0 and 0 <= d.wait_fraction <= 1
        assert sizing.producers_needed == pytest.approx(d.images_per_s * (1 + sizing.headroom)
                                                        / s.per_producer_images_per_s)
        assert sizing.desired_producers is not None and sizing.desired_producers >= 1 and sizing.pool_producers == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        for name in (PRODUCERS_NEEDED_METRIC, DESIRED_PRODUCERS_METRIC, "stoker_trainer_demand_images_per_s",
                     "stoker_trainer_input_wait_fraction", "stoker_trainer_producer_capacity_images_per_s"):
            assert name in families, name
        assert families[PRODUCERS_NEEDED_METRIC].samples[0].value > 0
        status = stoker_cli("status", "--metrics", f"http://127.0.0.1:{port}/metrics", "--interval", "0.2")
        assert status.returncode == 0, status.stderr
        assert "needs " in status.stdout and "producers (demand" in status.stdout
        assert re.search(r"pool: \d+ producers needed \(the sum of 1 trainer\(s\)' needs, [0-9.]+, rounded up once\); "
                         r"the pool has 1", status.stdout), status.stdout
