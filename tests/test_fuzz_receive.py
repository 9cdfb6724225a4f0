"""Direct receive fuzzed in the suite: seeded mutated ZMTP streams, next to a real libzmq producer.

A bounded slice of ``benchmarks/fuzz_receive.py`` (which runs 100,000 streams): no crash, no hang,
no corrupted or mixed batch delivered, and the real producer's batches keep arriving intact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fuzz_receive  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_streams_never_crash_hang_or_deliver_a_mixed_batch(seed):
    result = fuzz_receive.run(streams=400, seed=seed)
    assert result.streams == 400
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
