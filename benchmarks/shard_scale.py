#!/usr/bin/env python3
"""Sharded datasets of 10^3 to 10^6 shards: manifest size, time to open, and the pool scheduler's cost per split.

Nothing is stored but manifests: each size runs the real code on a dataset of ``--shard-records`` records a shard.

- ``manifest``: the ``manifest.json`` a sharded build writes for S shards (``Manifest.to_json``, the writer's code,
  over S real ``ShardInfo`` entries: names, counts, bytes, SHA-256s), its bytes in all and per shard; the real
  parser (``parse_manifest``) on it, with its tracemalloc peak; ``open_dataset`` on a folder holding only that
  manifest (it opens: open reads the manifest and touches no shard), what a producer then asks of it once
  (``records_per_shard`` and the first ``shard_of``, ``first_use_s``) and a ``shard_of`` after that. A manifest lists at most
  ``manifest.MAX_SHARDS`` (2^20) shards: beyond, the parse is refused and the row says so.
- ``tar_indexes``: a web-scale tar index (``--tar-shards``, LAION-5B in img2dataset tars of 10^4 samples is ~5.8 x
  10^5 tars) parsed in a fresh process each: ``parse_manifest`` on its JSON, and ``parse_compact`` on the compact
  form a daemon hands its workers (``Manifest.to_compact``): seconds, the process's peak RSS over its start
  (``peak_mb``, the data read included) and what stays resident once the data is dropped (``resident_mb``,
  ``resident_b_per_shard``). On the 2-core dev box, 10^6 tar shards (145 MB of JSON): parse 1.81 s, peak +897 MB
  (the data and json.loads' dicts, once, in the daemon), resident after 85 MB (85 B a shard); the compact form
  (66 MB, what each worker parses): 0.53 s, peak +311 MB, resident 83 MB. Before the shards were columns (commit
  9a1d429) the same JSON took 4.12 s, peak +853 MB and kept 650 MB (650 B a shard) in every producer worker, and
  a manifest over 10^5 shards was refused. At 10^5: JSON 0.18 s, resident 29 MB; compact 0.04 s, 14 MB (before:
  0.36 s, 70 MB).
- ``scheduler``: the real ``SplitScheduler`` of an elastic pool in epoch order 2 (``splits:N:seed:BxW:o2``, N = S x
  ``--shard-records``, nothing stored) with ``--producers`` producers each caching at most ``--cache-shards``
  shards (``ShardHoldings.note``). Each producer serves its oldest split: the records of its positions
  (``LazyOrder.records``, the producer's side, timed apart as ``serve_us``), in batches of ``BATCH`` through
  ``arrived`` and ``consumed``, then ``top_up`` hands it more. Per split handed out, in microseconds: ``top_up_us``,
  ``arrived_us``, ``consumed_us`` and their sum ``scheduler_us``. ``scheduler_mib``: tracemalloc's view of what
  the scheduler holds after the run (its epochs, the producers' modelled caches, the order's plans), measured in a
  second, shorter run (tracemalloc slows every allocation). Beside it, epoch order 1 (bitmaps, a materialised
  order) at ``--old-records`` records cut into ``--old-shards`` shards (order 1 refuses more than 10^8).

Prints two tables and writes JSON (default benchmarks/results/shard_scale.json).
Run:  python benchmarks/shard_scale.py [--shards 1e3,1e4,1e5,1e6] [--splits 600] [--producers 64]
             [--tar-shards 1e5,1e6]
"""

from __future__ import annotations

import gc
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np
from harness import add_out_argument, benchmark_parser, machine_info, write_results

from stoker.consumer.exact.pool.split_plan import SchedulerPlan
from stoker.producer.dataset.sources import open_dataset
from stoker.producer.dataset.sources.lmdb_format import DatasetError, DatasetMeta, FieldKind
from stoker.producer.dataset.sources.manifest import MANIFEST, MAX_SHARDS, Manifest, ShardInfo, parse_manifest
from stoker.protocol.input_state import RangeProgress, StreamKey, StreamProgress

BATCH, CREDIT, SEED = 256, 8, 7
SHARD_BYTES_PER_RECORD = 120_000  # what a shard of JPEGs weighs per record, about (only its digits count here)


# ---- the manifest --------------------------------------------------------------------------------------------

def manifest_json(shards: int, shard_records: int) -> bytes:
    """The manifest a sharded build of ``shards`` shards writes (``ShardedWriter.finish``: ``Manifest.to_json``)."""
    meta = DatasetMeta(count=shards * shard_records, fields={"image": FieldKind("image"), "label": FieldKind("int")},
                       classes=tuple(f"class-{c}" for c in range(1000)))
    width = 5 if shards <= 100_000 else 6
    infos = tuple(ShardInfo(f"shard-{j:0{width}d}", j * shard_records, shard_records,
                            shard_records * SHARD_BYTES_PER_RECORD + j, secrets.token_hex(32)) for j in range(shards))
    return Manifest(meta, infos).to_json().encode()


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = call()
    return value, time.perf_counter() - t0


def measure_manifest(shards: int, shard_records: int) -> dict[str, Any]:
    data = manifest_json(shards, shard_records)
    row: dict[str, Any] = {"shards": shards, "manifest_bytes": len(data), "bytes_per_shard": len(data) / shards}
    try:
        parsed, row["parse_s"] = _timed(lambda: parse_manifest(data, "bench"))
    except DatasetError as exc:
        return {**row, "refused": str(exc)}
    del parsed
    tracemalloc.start()  # apart: tracemalloc slows the parse several times
    parse_manifest(data, "bench")
    row["parse_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / MANIFEST).write_bytes(data)
        dataset, row["open_s"] = _timed(lambda: open_dataset(folder))
        _, row["first_use_s"] = _timed(lambda: (dataset.manifest.records_per_shard,
                                                dataset.manifest.shard_of(len(dataset) - 1)))
        _, row["shard_of_us"] = _timed(lambda: [dataset.manifest.shard_of(i) for i in range(0, len(dataset), 997)])
        row["shard_of_us"] *= 1e6 / len(range(0, len(dataset), 997))
        dataset.close()
    row["open_us_per_shard"] = 1e6 * row["open_s"] / shards
    return row


# ---- web-scale tar indexes, each parsed in a fresh process ---------------------------------------------------

def tar_index_json(shards: int) -> bytes:
    """A tar index of ``shards`` tars of about 10^4 samples (``stoker data index``'s shape), built as text."""
    records = 10_000 - np.arange(shards) % 7
    digests = os.urandom(32 * shards).hex()
    rows = ('{"name": "laion/%06d.tar", "records": %d, "bytes": %d, "sha256": "%s"}'
            % (i, r, 500_000_000 + i, digests[64 * i:64 * i + 64]) for i, r in enumerate(records.tolist()))
    return (('{"format": "stoker-shards", "version": 1, "shard_format": "tar", "root": "s3://bucket", "count": %d, '
             '"fields": {"image": "image", "text": "str"}, "shards": [' % int(records.sum())) + ", ".join(rows)
            + "]}").encode()


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse_alone(form: str, path: str, compact_out: str) -> dict[str, Any]:
    """In a fresh process (``--child``): parse the manifest at ``path`` (``form``: json or compact), timed, with the
    RSS it peaked at and keeps; the JSON's parse writes the compact form to ``compact_out``."""
    from stoker.producer.dataset.sources.shard_table.compact import parse_compact
    base = _resident()
    data = Path(path).read_bytes()
    parse = parse_manifest if form == "json" else parse_compact
    manifest, seconds = _timed(lambda: parse(data, path))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    size = len(data)
    del data
    gc.collect()
    resident = _resident() - base
    if form == "json":
        Path(compact_out).write_bytes(manifest.to_compact())
    shards = len(manifest.shards)
    return {"form": form, "shards": shards, "data_bytes": size, "parse_s": seconds, "peak_mb": peak / 1e6,
            "resident_mb": resident / 1e6, "resident_b_per_shard": resident / shards}


def measure_tar_index(shards: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        index, compact = Path(folder) / "index.json", Path(folder) / "index.compact"
        index.write_bytes(tar_index_json(shards))
        for form, path in (("json", index), ("compact", compact)):
            done = subprocess.run([sys.executable, __file__, "--child", form, str(path), str(compact)],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


# ---- the scheduler -------------------------------------------------------------------------------------------

def pool_key(shards: int, shard_records: int, order: int) -> StreamKey:
    return StreamKey.parse(f"splits:{shards * shard_records}:{SEED}:{shard_records}x1" + (":o2" if order == 2 else ""))


class PoolRun:
    """One pool's scheduler and producers, served split by split (module doc)."""

    def __init__(self, key: StreamKey, producers: int, cache_shards: int) -> None:
        self.key = key
        self.progress: Any = RangeProgress(key.records) if key.order_version == 2 else StreamProgress(key.records)
        self.scheduler = SchedulerPlan(BATCH, CREDIT).scheduler(key, self.progress, self._complete, None)
        for p in range(producers):
            self.scheduler.holdings.note(p, cache_shards, [])
        self.producers = producers
        self.queue: deque = deque()  # (producer, work item), oldest first
        self.orders: dict[int, np.ndarray] = {}  # order 1's epochs, materialised
        self.times = {"top_up": 0.0, "arrived": 0.0, "consumed": 0.0, "serve": 0.0}
        self.handed = 0
        for p in range(producers):
            self._top_up(p)

    def _complete(self, epoch: int) -> None:
        self.progress.advance(epoch + 1)

    def _top_up(self, producer: int) -> None:
        items, seconds = _timed(lambda: self.scheduler.top_up(producer, now=0.0))
        self.times["top_up"] += seconds
        self.handed += len(items)
        self.queue.extend((producer, item) for item in items)

    def _records(self, item: Any) -> np.ndarray:
        if self.key.order_version == 2:
            records = self.key.lazy_order().records(item.epoch, item.start, item.end)
        else:
            if item.epoch not in self.orders:
                self.orders = {item.epoch: self.key.order(item.epoch)}
            records = self.orders[item.epoch][item.start:item.end]
        keep = np.ones(len(records), bool)
        keep[np.asarray(item.skip, np.int64)] = False
        return records[keep]

    def serve(self, splits: int) -> None:
        """Serve ``splits`` splits, each producer its oldest, topping it up after each."""
        served = 0
        while served < splits and self.queue:
            producer, item = self.queue.popleft()
            records, seconds = _timed(lambda: self._records(item))
            self.times["serve"] += seconds
            for at in range(0, len(records), BATCH):
                chunk = records[at:at + BATCH]
                epochs = np.full(len(chunk), item.epoch, np.int64)
                keep, seconds = _timed(lambda: self.scheduler.arrived(epochs, chunk, np.ones(len(chunk), bool),
                                                                      producer, now=0.0))
                self.times["arrived"] += seconds
                _, seconds = _timed(lambda: self.scheduler.consumed(epochs[keep], chunk[keep]))
                self.times["consumed"] += seconds
            served += 1
            self._top_up(producer)


def measure_scheduler(shards: int, shard_records: int, order: int, producers: int, cache_shards: int,
                      splits: int) -> dict[str, Any]:
    key = pool_key(shards, shard_records, order)
    run, open_s = _timed(lambda: PoolRun(key, producers, cache_shards))
    handed_at_start = run.handed
    warm = run.times["top_up"]
    run.times["top_up"] = 0.0
    run.handed = 0
    run.serve(splits)
    per = 1e6 / max(1, run.handed)
    row = {"shards": shards, "records": key.records, "epoch_order": order, "key": str(key),
           "split": run.scheduler.split, "producers": producers, "cache_shards": cache_shards,
           "splits_handed": run.handed, "open_s": open_s - warm, "first_top_ups_us": 1e6 * warm / handed_at_start,
           **{f"{name}_us": seconds * per for name, seconds in run.times.items()}}
    row["scheduler_us"] = row["top_up_us"] + row["arrived_us"] + row["consumed_us"]
    del run
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    run = PoolRun(key, producers, cache_shards)
    run.orders = {}  # order 1's materialised order is the producer's, not the scheduler's
    run.serve(max(1, splits // 4))
    run.orders = {}
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {**row, "scheduler_mib": (current - before) / 2**20, "scheduler_peak_mib": (peak - before) / 2**20}


# ---- the run ------------------------------------------------------------------------------------------------

def _counts(text: str) -> list[int]:
    return [int(float(v)) for v in text.split(",") if v]


def _print(manifests: list[dict[str, Any]], pools: list[dict[str, Any]]) -> None:
    print(f"{'shards':>9} {'manifest B':>12} {'B/shard':>8} {'parse s':>8} {'peak MiB':>9} {'open s':>7} "
          f"{'us/shard':>9} {'1st use s':>9} {'shard_of us':>11}")
    for r in manifests:
        if "refused" in r:
            print(f"{r['shards']:>9,} {r['manifest_bytes']:>12,} {r['bytes_per_shard']:>8.1f}  refused: over "
                  f"MAX_SHARDS ({MAX_SHARDS:,})")
            continue
        print(f"{r['shards']:>9,} {r['manifest_bytes']:>12,} {r['bytes_per_shard']:>8.1f} {r['parse_s']:>8.3f} "
              f"{r['parse_peak_mib']:>9.1f} {r['open_s']:>7.3f} {r['open_us_per_shard']:>9.2f} "
              f"{r['first_use_s']:>9.4f} {r['shard_of_us']:>11.2f}")
    print()
    print(f"{'shards':>9} {'records':>15} {'o':>1} {'open s':>7} {'top_up':>7} {'arrived':>8} {'consumed':>8} "
          f"{'sched us':>9} {'serve us':>9} {'MiB':>7} {'peak MiB':>8}")
    for r in pools:
        print(f"{r['shards']:>9,} {r['records']:>15,} {r['epoch_order']:>1} {r['open_s']:>7.3f} {r['top_up_us']:>7.0f} "
              f"{r['arrived_us']:>8.0f} {r['consumed_us']:>8.0f} {r['scheduler_us']:>9.0f} {r['serve_us']:>9.0f} "
              f"{r['scheduler_mib']:>7.2f} {r['scheduler_peak_mib']:>8.2f}")


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--shards", default="1e3,1e4,1e5,1e6", help="shard counts (manifest and order 2)")
    parser.add_argument("--shard-records", type=int, default=10_000)
    parser.add_argument("--producers", type=int, default=64)
    parser.add_argument("--cache-shards", type=int, default=8, help="shards each producer caches at most")
    parser.add_argument("--splits", type=int, default=600, help="splits served per size (timed)")
    parser.add_argument("--old-shards", default="1e3,1e4", help="shard counts in epoch order 1")
    parser.add_argument("--old-records", type=float, default=1e7, help="records of order 1's dataset")
    parser.add_argument("--tar-shards", default="1e5,1e6", help="tar indexes parsed in a fresh process (JSON, compact)")
    add_out_argument(parser, "shard_scale.json")
    args = parser.parse_args()
    shards = _counts(args.shards)
    manifests = [measure_manifest(s, args.shard_records) for s in shards]
    tar_indexes = [row for s in _counts(args.tar_shards) for row in measure_tar_index(s)]
    for r in tar_indexes:
        print(f"tar index {r['shards']:>9,} {r['form']:>7}: {r['data_bytes'] / 1e6:7.1f} MB, parse {r['parse_s']:6.2f} s, "
              f"peak +{r['peak_mb']:6.0f} MB, resident {r['resident_mb']:6.1f} MB "
              f"({r['resident_b_per_shard']:.0f} B a shard)")
    pools = [measure_scheduler(s, args.shard_records, 2, args.producers, args.cache_shards, args.splits)
             for s in shards]
    pools += [measure_scheduler(s, int(args.old_records) // s, 1, args.producers, args.cache_shards, args.splits)
              for s in _counts(args.old_shards)]
    _print(manifests, pools)
    write_results(args.out, {"machine": machine_info(), "batch": BATCH, "shard_records": args.shard_records,
                             "manifests": manifests, "tar_indexes": tar_indexes, "pools": pools})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(parse_alone(*sys.argv[2:5])))
    else:
        main()
