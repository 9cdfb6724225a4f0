#!/usr/bin/env python3
"""Bytes one trainer's hellos send to its producers: the whole input state to each (old) against the progress
of the stream each serves (new, ``consumer/exact/hello_state.py``), issue 41.

A job of fixed shards ``I/P`` (P producers, one stream each) over N records, one trainer mid-epoch: half of each
shard's epoch consumed, a random half (what a shuffled epoch's first half is; its bitmap does not compress). Each
figure is the length of the real ``encode_hello`` frame of the state the control plane picks for that producer
(``hello_state``: the trainer's whole state before, its stream's progress now), with no held records (the same
in both). The old hello is the same bytes for every producer: encoded once, counted P times. Every new hello is
decoded back and must name its producer's stream alone.

Today's stream keys refuse 10^8 records, so the 10^9-record figures are projections, linear in N from the two
largest sizes measured, and labelled so.

Run:  python benchmarks/hello_bytes.py [--records 1000000,10000000] [--producers 16,64,256]   (table + JSON)
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from harness import add_out_argument, benchmark_parser, machine_info, write_results
from stoker.consumer.exact.hello_state import hello_state
from stoker.protocol.exact_messages import Hello, decode_trainer_message, encode_hello
from stoker.protocol.input_state import InputState, StreamKey

PROJECTED_RECORDS = 10**9
TRAINER, CREDIT = "trainer-0", 8


def mid_epoch_state(records: int, producers: int, seed: int = 0) -> tuple[InputState, list[str]]:
    """One trainer's state over fixed shards ``I/producers`` of ``records`` records (module doc), and the keys."""
    rng = np.random.default_rng(seed)
    state = InputState()
    keys = [str(StreamKey(i, producers, records, seed=seed)) for i in range(producers)]
    for key in keys:
        served = StreamKey.parse(key).stream_records()
        done = rng.choice(served, len(served) // 2, replace=False)
        state.mark(key, np.zeros(len(done), np.int64), done)
    return state, keys


def hello_bytes(state: InputState, stream: str) -> bytes:
    """The hello a trainer sends the producer of ``stream`` (``held`` empty)."""
    return encode_hello(Hello(TRAINER, 1, CREDIT, hello_state(state, stream)))


def measure(records: int, producers: int) -> dict[str, Any]:
    state, keys = mid_epoch_state(records, producers)
    old_each = len(encode_hello(Hello(TRAINER, 1, CREDIT, hello_state(state, ""))))  # the whole state
    t0 = time.perf_counter()
    new = [hello_bytes(state, key) for key in keys]
    new_s = time.perf_counter() - t0
    for key, frame in zip(keys, new):
        named = list(decode_trainer_message(frame).state.streams)  # type: ignore[union-attr]
        if named != [key]:
            raise AssertionError(f"the hello to the producer of {key} names {named}")
    new_total = sum(map(len, new))
    return {"records": records, "producers": producers, "old_per_producer": old_each,
            "old_total": old_each * producers, "new_per_producer_max": max(map(len, new)),
            "new_total": new_total, "ratio": old_each * producers / new_total, "new_encode_s": new_s}


def projected(rows: list[dict[str, Any]], producers: int) -> dict[str, Any] | None:
    """Old and new totals at ``PROJECTED_RECORDS`` for ``producers``, linear in N from the two largest sizes."""
    measured = sorted((r for r in rows if r["producers"] == producers), key=lambda r: r["records"])[-2:]
    if len(measured) < 2:
        return None
    (a, b), n = measured, PROJECTED_RECORDS

    def line(field: str) -> float:
        slope = (b[field] - a[field]) / (b["records"] - a["records"])
        return b[field] + slope * (n - b["records"])

    return {"records": n, "producers": producers, "old_per_producer": line("old_per_producer"),
            "old_total": line("old_total"), "new_per_producer_max": line("new_per_producer_max"),
            "new_total": line("new_total"), "from_records": [a["records"], b["records"]]}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", default="1000000,10000000", help="dataset sizes, comma-separated (< 10^8)")
    parser.add_argument("--producers", default="16,64,256", help="producer counts P (fixed shards I/P)")
    add_out_argument(parser, "hello_bytes.json")
    args = parser.parse_args()
    sizes = [int(n) for n in args.records.split(",")]
    counts = [int(p) for p in args.producers.split(",")]
    rows = [measure(n, p) for n in sizes for p in counts]
    projections = [p for p in (projected(rows, c) for c in counts) if p is not None]
    print("bytes one trainer's hellos send to P fixed-shard producers (I/P), mid-epoch; old: the whole state to "
          "each, new: each producer its stream's progress")
    print(f"{'records':>13} | {'P':>4} | {'old/producer':>13} | {'old total':>14} | {'new/producer':>12} | "
          f"{'new total':>11} | {'old/new':>7}")
    print("-" * 98)
    for r in rows:
        print(f"{r['records']:>13,} | {r['producers']:>4} | {r['old_per_producer']:>13,} | {r['old_total']:>14,} | "
              f"{r['new_per_producer_max']:>12,} | {r['new_total']:>11,} | {r['ratio']:>7.1f}")
    for p in projections:
        print(f"{p['records']:>13,} | {p['producers']:>4} | {p['old_per_producer']:>13,.0f} | "
              f"{p['old_total']:>14,.0f} | {p['new_per_producer_max']:>12,.0f} | {p['new_total']:>11,.0f} | "
              f"{p['old_total'] / p['new_total']:>7.1f}   PROJECTED, linear from {p['from_records'][0]:,} and "
              f"{p['from_records'][1]:,} records")
    write_results(args.out, {"benchmark": "hello_bytes", "machine": machine_info(), "rows": rows,
                             "projected": projections})


if __name__ == "__main__":
    main()
