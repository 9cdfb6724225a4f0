#!/usr/bin/env python3
"""Shard fetches per epoch of an elastic pool reading object storage: shard-aware assignment against one that
ignores shards, in one run.

A real S3 server runs on loopback (SeaweedFS, local_s3.py) holding a sharded synthetic dataset. A pool of
``--producers`` real producer daemons (``--shard auto``), each with its own empty cache whose budget is a quarter
of the dataset (``--cache-fraction``), serves ``--epochs`` exact epochs to one trainer (``BatchStream``, exact).
Rounds alternate two pools over the same two-level epoch order (shard by shard, ``--shuffle-window 1``):

- aware: producers tell the trainer what their caches hold (the default), and it hands each split to a
  producer that holds its shard (consumer/exact/pool/shard_affinity.py);
- blind: ``--shard-affinity off``: the trainer hands splits to whoever has room, as before this change.

Counted: every fetch each producer's cache made (``fetches.jsonl``), per epoch, and the trainer's exactly-once
counts (records seen twice, records never seen). Goal (issue 33): blind / aware >= 3 with 0 twice, 0 never.
Fetches of the first epoch fill empty caches either way; the steady state is the later epochs.
Prints a table and writes JSON (default benchmarks/results/shard_fetches.json).
Run:  python benchmarks/shard_fetches.py [--records 1024] [--shards 16] [--producers 4] [--epochs 4] [--rounds 2]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from harness import (add_out_argument, benchmark_parser, launch_producer, machine_info, producer_flags, run_stoker,
                     write_results)
from local_s3 import LocalS3


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=1024, help="synthetic JPEGs")
    parser.add_argument("--shards", type=int, default=16, help="shards of the dataset (about)")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="each cache's budget, of the dataset")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind, interleaved")
    add_out_argument(parser, "shard_fetches.json")
    return parser.parse_args()


def _dataset(tmp: Path, args, s3: LocalS3) -> tuple[str, int, int]:
    """Synthesize and upload the sharded dataset; (its URL, shards, bytes)."""
    from stoker.producer.dataset.sources import open_dataset
    from stoker.producer.dataset.build.synthetic import build_synthetic

    build_synthetic(tmp / "probe", args.records, seed=0, progress=False)
    total = (tmp / "probe" / "data.mdb").stat().st_size
    run_stoker("lmdb", "synth", str(tmp / "sharded"), "--count", str(args.records), "--seed", "0",
            "--shard-size", str(max(1, total // args.shards)), "--quiet", env=s3.environment())
    run_stoker("lmdb", "upload", str(tmp / "sharded"), "s3://stoker/fetches", "--s3-endpoint", s3.endpoint,
            env=s3.environment())
    with open_dataset(tmp / "sharded") as sharded:
        return "s3://stoker/fetches", len(sharded.manifest.shards), sharded.size_bytes()


def _round(url: str, args, s3: LocalS3, caches: list[Path], budget: int, aware: bool) -> dict:
    from stoker.consumer import BatchStream
    from stoker.producer.dataset.sources.shard_cache import fetch_log

    flags = producer_flags(args.batch_size, 32, workers=1, seed=0, shard="auto", epochs=args.epochs)
    flags += ["--s3-endpoint", s3.endpoint, "--cache-size", str(budget), "--shuffle-window", "1",
              "--shard-affinity", "on" if aware else "off"]
    seen: Counter = Counter()
    started = time.perf_counter()
    with ExitStack() as stack:
        producers = [stack.enter_context(launch_producer(url, [*flags, "--cache-dir", str(cache)],
                                                         env=s3.environment())) for cache in caches]
        with BatchStream([p.endpoint for p in producers], exact=True, recv_timeout=120) as stream:
            for batch in stream:
                seen.update(zip(batch["epoch"].tolist(), batch["index"].tolist()))
    seconds = time.perf_counter() - started
    fetches = [len(fetch_log(c)) for c in caches]
    expected = {(e, i) for e in range(args.epochs) for i in range(args.records)}
    return {"fetches": sum(fetches), "per_producer": fetches, "seconds": seconds,
            "twice": sum(1 for n in seen.values() if n > 1), "never": len(expected - set(seen)),
            "foreign": len(set(seen) - expected)}


def main() -> None:
    args = parse_args()
    rounds: dict[str, list] = {"aware": [], "blind": []}
    with tempfile.TemporaryDirectory() as tmp, LocalS3(Path(tmp) / "s3") as s3:
        tmp_path = Path(tmp)
        url, shards, total = _dataset(tmp_path, args, s3)
        budget = int(total * args.cache_fraction)
        for r in range(args.rounds):
            for kind in (("aware", "blind") if r % 2 == 0 else ("blind", "aware")):
                caches = [tmp_path / f"{kind}{r}-cache{i}" for i in range(args.producers)]
                rounds[kind].append(_round(url, args, s3, caches, budget, kind == "aware"))
                print(f"round {r} {kind}: {rounds[kind][-1]}", flush=True)
    median = {k: statistics.median(x["fetches"] for x in v) for k, v in rounds.items()}
    exact = {k: (sum(x["twice"] for x in v), sum(x["never"] for x in v)) for k, v in rounds.items()}
    print(f"{args.producers} producers (--shard auto), caches of {args.cache_fraction:.2f} of the dataset each; "
          f"{shards} shards ({total / 1e6:.1f} MB), {args.records} records, {args.epochs} epochs; "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'assignment':>12} | {'fetches':>7} | {'per epoch':>9} | {'of shards/epoch':>15} | {'twice':>5} | "
          f"{'never':>5}")
    for kind in ("aware", "blind"):
        per_epoch = median[kind] / args.epochs
        print(f"{kind:>12} | {median[kind]:>7.0f} | {per_epoch:>9.1f} | {per_epoch / shards:>15.2f} | "
              f"{exact[kind][0]:>5} | {exact[kind][1]:>5}")
    ratio = median["blind"] / max(1, median["aware"])
    print(f"blind / aware fetches: {ratio:.2f} (goal >= 3)")
    write_results(args.out, {"benchmark": "shard_fetches", "records": args.records, "shards": shards,
                             "dataset_bytes": total, "producers": args.producers, "epochs": args.epochs,
                             "cache_fraction": args.cache_fraction, "cache_bytes": budget,
                             "median_fetches": median, "ratio_blind_to_aware": ratio, "target_ratio": 3.0,
                             "exactly_once": {k: {"twice": t, "never": n} for k, (t, n) in exact.items()},
                             "rounds": rounds, **machine_info()})


if __name__ == "__main__":
    main()
