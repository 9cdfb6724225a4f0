#!/usr/bin/env python3
"""Exact mode's state at 10^6, 10^8 and 10^10 records: checkpoint bytes, trainer bookkeeping memory, save and restore.

Records are not stored: the trainer's real bookkeeping runs on a simulated dataset (issue 41's method). For each
size, a pool in epoch order 2 over shards of ``--shard-records`` records (``splits:N:seed:Bx1:o2``) is restored
mid-epoch: the first half of epoch 0 consumed, as a run that handed splits out in order leaves it (one range).
Then ``--producers`` producers (1,024) each take their splits from the real ``SplitScheduler`` and serve them
through the real ``arrived``/``consumed`` path and the real ``ConsumedLedger``: one split whole, the next half,
with 1 % of the rows held (arrived, never consumed: holes, as rows queued for a step leave). Measured:

- ``state_bytes``: ``save_state()`` at that point (what a checkpoint holds);
- ``bookkeeping_mib``: the peak of what tracemalloc saw allocated from the restore to the save (the ledger, the
  scheduler, its open epochs, the epoch order's plans);
- ``save_s``, ``restore_s``: ``save_state()``; ``ConsumedLedger.start`` with those bytes plus a new scheduler
  opening its epochs (what a trainer does before its first batch).

Also rank 0 of 2 trainers at ``--world-sizes`` (its share is blocks of splits: a few thousand ranges). Beside it,
the old format (epoch order 1, bitmaps) at sizes it accepts (10^6, 10^7 records; it refuses 10^8),
run the same way. Prints a table and writes JSON (default benchmarks/results/exact_scale.json).
Run:  python benchmarks/exact_scale.py [--producers 1024] [--sizes 1e6,1e8,1e10] [--old-sizes 1e6,1e7]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from typing import Any

import numpy as np
from harness import add_out_argument, benchmark_parser, machine_info, write_results

from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.pool.range_split_epoch import SplitCut
from stoker.consumer.exact.pool.split_plan import SchedulerPlan, split_records
from stoker.consumer.exact.state import SavedState, pack_state
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.input_state import InputState, RangeProgress, StreamKey, StreamProgress

BATCH, CREDIT, SEED = 256, 8, 7
HOLES = 0.01


def _restored(key: StreamKey, split: int, world: int = 1) -> bytes:
    """Rank 0 of ``world``'s state with the first half of epoch 0 consumed (of its share), split by split in order."""
    text = str(key)
    if key.order_version == 2:
        cut = SplitCut(key.lazy_order(), 0, key.records, split)
        half = cut.bounds_of(np.array([cut.split_count // 2]))[0][0]
        share = cut.share(0, world, key.records)
        ends = np.minimum(share.ends, half)
        consumed = PositionRanges.from_ranges(share.starts[ends > share.starts], ends[ends > share.starts], key.records)
        progress: Any = RangeProgress(key.records, 0, {0: consumed})
    else:
        order = key.order(0)
        progress = StreamProgress(key.records)
        progress.consumed(0)[order[: key.records // 2]] = True
    return pack_state(SavedState("trainer-bench", InputState({text: progress}), (0, world), {text: split}))


def _start(state: bytes, key: StreamKey, split: int, world: int = 1) -> tuple[ConsumedLedger, Any]:
    ledger = ConsumedLedger.start(state, None, (0, world))
    text = str(key)
    with ledger.lock:
        ledger.note_split(text, split)
        scheduler = SchedulerPlan(BATCH, CREDIT, (0, world)).scheduler(
            key, ledger.pool_progress(text), lambda e: ledger.complete_pool_epoch(text, e), None)
    return ledger, scheduler


def _records_of(key: StreamKey, item: Any, orders: dict) -> np.ndarray:
    if key.order_version == 2:
        records = key.lazy_order().records(item.epoch, item.start, item.end)
    else:
        if item.epoch not in orders:
            orders[item.epoch] = key.order(item.epoch)
        records = orders[item.epoch][item.start:item.end]
    keep = np.ones(len(records), bool)
    keep[np.asarray(item.skip, np.int64)] = False
    return records[keep]


def _serve(ledger: ConsumedLedger, scheduler: Any, key: StreamKey, producers: int, rng: np.random.Generator) -> int:
    """Every producer takes its splits and serves the first whole and half the second; 1 % of rows held."""
    text, orders, rows = str(key), {}, 0
    for p in range(producers):
        with ledger.lock:
            items = scheduler.top_up(p, now=0.0)
        for n, item in enumerate(items[:2]):
            records = _records_of(key, item, orders)
            if n == 1:
                records = records[: len(records) // 2]
            for at in range(0, len(records), BATCH):
                chunk = records[at:at + BATCH]
                epochs = np.full(len(chunk), item.epoch, np.int64)
                with ledger.lock:
                    keep = scheduler.arrived(epochs, chunk, np.ones(len(chunk), bool), p, now=0.0)
                    taken = keep & (rng.random(len(chunk)) >= HOLES)
                    ledger.mark(text, epochs[taken], chunk[taken])
                    scheduler.consumed(epochs[taken], chunk[taken])
                rows += len(chunk)
    return rows


def measure(records: int, order: int, producers: int, shard_records: int, world: int = 1) -> dict[str, Any]:
    key = StreamKey.parse(f"splits:{records}:{SEED}:{shard_records}x1" + (":o2" if order == 2 else ""))
    split = split_records(records, BATCH, world)
    state = _restored(key, split, world)
    tracemalloc.start()
    started = time.perf_counter()
    ledger, scheduler = _start(state, key, split, world)
    restore_first_s = time.perf_counter() - started
    served = _serve(ledger, scheduler, key, producers, np.random.default_rng(1))
    t0 = time.perf_counter()
    saved = ledger.save_state()
    save_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    t0 = time.perf_counter()
    _start(saved, key, split, world)
    restore_s = time.perf_counter() - t0
    progress = ledger.saved().state.streams[str(key)]
    ranges = sum(r.range_count for r in progress.open.values()) if order == 2 else None
    return {"records": records, "epoch_order": order, "producers": producers, "world": world, "split": split,
            "rows_served": served, "state_bytes": len(saved), "bits_per_record": 8 * len(saved) / records,
            "open_ranges": ranges, "bookkeeping_mib": peak / 2**20, "save_s": save_s, "restore_s": restore_s,
            "first_restore_s": restore_first_s}


def _sizes(text: str) -> list[int]:
    return [int(float(v)) for v in text.split(",") if v]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--producers", type=int, default=1024)
    parser.add_argument("--sizes", default="1e6,1e8,1e10", help="records, epoch order 2")
    parser.add_argument("--old-sizes", default="1e6,1e7", help="records, epoch order 1 (the old format)")
    parser.add_argument("--shard-records", type=int, default=10_000)
    parser.add_argument("--world-sizes", default="1e10", help="records, epoch order 2, as rank 0 of 2 trainers")
    add_out_argument(parser, "exact_scale.json")
    args = parser.parse_args()
    rows = [measure(n, 2, args.producers, args.shard_records) for n in _sizes(args.sizes)]
    rows += [measure(n, 2, args.producers, args.shard_records, world=2) for n in _sizes(args.world_sizes)]
    rows += [measure(n, 1, args.producers, args.shard_records) for n in _sizes(args.old_sizes)]
    print(f"{'records':>14} {'order':>5} {'world':>5} {'state bytes':>12} {'bits/rec':>9} {'ranges':>7} {'MiB':>7} "
          f"{'save s':>7} {'restore s':>9}")
    for r in rows:
        print(f"{r['records']:>14,} {r['epoch_order']:>5} {r['world']:>5} {r['state_bytes']:>12,} {r['bits_per_record']:>9.5f} "
              f"{r['open_ranges'] if r['open_ranges'] is not None else '-':>7} {r['bookkeeping_mib']:>7.1f} "
              f"{r['save_s']:>7.3f} {r['restore_s']:>9.3f}")
    write_results(args.out, {"machine": machine_info(), "batch": BATCH, "holes": HOLES, "rows": rows})


if __name__ == "__main__":
    main()
