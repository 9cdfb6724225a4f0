"""Direct receive fuzzed in the suite: seeded mutated ZMTP streams, next to a real libzmq producer; read as plain
direct receive (PULL) and as exact mode's link (DEALER, statuses between batches).

A bounded slice of ``benchmarks/fuzz_receive.py`` (which runs 100,000 streams): no crash, no hang,
no corrupted or mixed batch delivered, and the real producer's batches keep arriving intact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fuzz_receive  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("socket_type, seed", [("PULL", 1), ("PULL", 2), ("DEALER", 1), ("DEALER", 2)])
def test_mutated_streams_never_crash_hang_or_deliver_a_mixed_batch(socket_type, seed):
    result = fuzz_receive.run(streams=400, seed=seed, socket_type=socket_type)
    assert result.streams == 400
    if socket_type == "DEALER":
        assert result.statuses > 0  # exact mode's statuses were among what was read
    assert result.crashes == 0, result.crash_examples[:3]
    assert result.hangs == 0 and result.corrupted == 0
    assert result.rejected > 0 and result.batches_delivered > 0  # the mutations did reach the parser
    assert result.producer_batches > 0 and result.producer_corrupted == 0
    assert result.rss_peak_mib - result.rss_start_mib < 64


def test_the_mutator_is_seeded():
    import random

    # Byte for byte but for each header's send time: the same seed gives the same mutations.
    a = [len(fuzz_receive.mutated_stream(random.Random(seed))) for seed in range(20)]
    b = [len(fuzz_receive.mutated_stream(random.Random(seed))) for seed in range(20)]
    assert a == b and len(set(a)) > 1
