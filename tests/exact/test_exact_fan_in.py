"""Exact mode's direct receive from many real producers on a bounded number of threads (issue 41).

Twelve real one-worker producers, each serving a fixed shard of a tiny dataset once: the epoch is whole only
if every producer's connection carried its shard, and the trainer's receive threads (its control plane's and
its connection loop's) stay at ``MAX_THREADS`` however many producers it reads.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest

from stoker.consumer.numpy.batch_stream import BatchStream
from stoker.consumer.transport.connection_loop import MAX_THREADS
from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import assert_exactly_once, count_rows, one_worker_producer

pytestmark = pytest.mark.timeout(300)

PRODUCERS, BATCH = 12, 4
RECORDS = PRODUCERS * 2 * BATCH - 5  # two batches a shard, a few partial


@pytest.fixture(scope="module")
def fan_in_lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fan_in") / "ds"
    build_synthetic(path, RECORDS, seed=5, num_classes=4, progress=False)
    return path


def _exact_receive_threads() -> list[str]:
    """The core's thread (which runs the control plane) and the connection loop's."""
    return [t.name for t in threading.enumerate() if t.name == "stoker-receive" or t.name.startswith("stoker-exact-")]


def test_a_trainer_reading_12_exact_producers_uses_at_most_8_receive_threads_and_gets_every_record_once(
        fan_in_lmdb: Path) -> None:
    seen: Counter = Counter()
    most_threads = 0
    with ExitStack() as stack:
        producers = [stack.enter_context(one_worker_producer(
            fan_in_lmdb, "--shard", f"{i}/{PRODUCERS}", "--epochs", "1", "--mode", "eval", "--seed", "3",
            batch=BATCH, size=16)) for i in range(PRODUCERS)]
        with BatchStream([p.endpoint for p in producers], exact=True, recv_timeout=120, receive="direct") as stream:
            for batch in stream:  # to the end of the run: every shard served once
                count_rows(batch, seen)
                most_threads = max(most_threads, len(_exact_receive_threads()))
            served = {name: n for name, n in stream.stats.per_producer.items() if n}
        assert not [name for name in _exact_receive_threads() if name != "stoker-receive"]  # the loop is closed
    assert_exactly_once(seen.elements(), set(range(RECORDS)))
    assert len(served) == PRODUCERS, served  # every connection carried its shard
    assert PRODUCERS > most_threads and 2 <= most_threads <= MAX_THREADS == 8, most_threads
