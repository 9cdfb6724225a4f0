#!/usr/bin/env python3
"""One real exact-mode run in epoch order 2 (issue 41): each record once through producer and trainer SIGKILLs
and a resume on another number of trainers.

- Data: a Stoker LMDB of ``--records`` (10^6) records written by the real builder (``write_lmdb``). Each record is
  an 8 x 8 JPEG (one of 256, drawn once) and a label: the cheapest record the builder takes that the producers
  still decode and resize like any photo. 10^6 photo-sized synthetic JPEGs (``build_synthetic``) would take hours
  and 100 GB here. Built once into ``--data`` and reused.
- Producers: ``--producers`` real ``stoker produce --shard auto --epochs 1 --epoch-order 2`` daemons (an elastic
  pool, state kept as ranges), tiny images, large batches.
- Trainer A (a process, world 1): ``BatchStream`` in exact mode; it appends every (epoch, index) it consumed to a
  log (unbuffered: a SIGKILL loses none) and every ``--checkpoint-every`` batches writes ``save_state()`` and the
  log's length at that step. At 25% of the epoch it stops taking batches and says so on a pipe: one producer is
  SIGKILLed and restarted on its address, and A is told to go on; at 50% A SIGKILLs itself. Both at a step, not at
  a time, so a run at any speed kills in the same places (``tests/house/test_exact_real_run_benchmark.py``).
- Resume: A's last checkpoint (a lone trainer's state is a job state of world 1) goes through ``merge_states`` and
  two trainer processes, ranks 0 and 1 of 2, continue from it to the end of the epoch.
- Count: the records in A's checkpoint (its log up to the checkpointed length) plus every record the two ranks
  consumed: 0 twice and 0 never is the claim. What A consumed after its checkpoint is served again by design (its
  model was not checkpointed) and is reported apart.
Reports wall time, images/s per phase, checkpoint bytes, merge and restore seconds. Prints a table and writes JSON
(default benchmarks/results/exact_real_run.json). Several minutes on 2 cores; not for CI.
Run:  python benchmarks/exact_real_run.py [--records 1000000] [--producers 3] [--batch 1024] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness import add_out_argument, benchmark_parser, launch_producer, machine_info, producer_flags, write_results

ROW_BYTES = 16  # a log row: (epoch, index) as two little-endian int64
WAIT_S = 1800.0  # bound on a trainer's run: one that stalls fails (its recv_timeout first), never hangs


# ---- the trainer process ----------------------------------------------------------------------

def trainer_main(args: argparse.Namespace) -> None:
    """Consume to the end of the run, logging rows and checkpointing; the orchestrator may SIGKILL it any time."""
    from stoker.consumer.numpy.batch_stream import BatchStream

    resume = Path(args.resume).read_bytes() if args.resume else None
    rank, world = (int(v) for v in args.share.split("/"))
    out = Path(args.dir)
    started = time.perf_counter()
    stream = BatchStream(args.connect.split(","), exact=True, recv_timeout=120, resume_state=resume,
                         trainer_id=None if resume else args.trainer_id, share=(rank, world))
    opened = time.perf_counter()
    first_batch_s, steps, rows, paused = None, 0, 0, False
    with stream, open(out / "rows.bin", "ab", buffering=0) as log:
        for batch in stream:
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - opened
            pairs = np.stack([batch["epoch"].astype("<i8"), batch["index"].astype("<i8")], axis=1)
            log.write(pairs.tobytes())
            steps, rows = steps + 1, rows + len(pairs)
            if steps % args.checkpoint_every == 0:
                _checkpoint(out, steps, rows, stream.save_state())
            if args.pause_at_rows and rows >= args.pause_at_rows and not paused:
                paused = True
                print("paused", flush=True)
                sys.stdin.readline()  # the orchestrator answers once the producer is killed and restarted
            if args.die_at_rows and rows >= args.die_at_rows:
                os.kill(os.getpid(), signal.SIGKILL)
    (out / "done.json").write_text(json.dumps({"open_s": opened - started, "first_batch_s": first_batch_s,
                                               "steps": steps, "rows": rows}))


def _checkpoint(out: Path, step: int, rows: int, state: bytes) -> None:
    """The state, then a JSON naming it and the log length at this step, written last (its presence = complete)."""
    (out / f"ckpt-{step:08d}.state").write_bytes(state)
    meta = out / f"ckpt-{step:08d}.json.tmp"
    meta.write_text(json.dumps({"step": step, "rows": rows, "state_bytes": len(state)}))
    os.replace(meta, out / f"ckpt-{step:08d}.json")


# ---- the orchestrator -------------------------------------------------------------------------

def build_dataset(path: Path, records: int) -> float:
    """Seconds to write ``records`` tiny-JPEG records at ``path`` with ``write_lmdb``; 0 when already there."""
    built = path.with_name(path.name + ".built.json")  # written once the build is whole
    if built.exists() and json.loads(built.read_text()).get("records") == records and path.exists():
        return 0.0
    import cv2
    from stoker.producer.dataset.build.write_records import write_lmdb

    rng = np.random.default_rng(0)
    jpegs = [cv2.imencode(".jpg", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))[1].tobytes() for _ in range(256)]
    started = time.perf_counter()
    report = write_lmdb(path, ({"image": jpegs[i % 256], "label": i % 10} for i in range(records)),
                        classes=[f"class_{c}" for c in range(10)], overwrite=True, progress=True, total=records)
    if report.skipped:
        raise RuntimeError(f"the builder left out {len(report.skipped)} records: {report.skipped[:3]}")
    seconds = time.perf_counter() - started
    built.write_text(json.dumps({"records": records, "build_s": seconds}))
    return seconds


def _trainer(folder: Path, addresses: list[str], args: argparse.Namespace, share: str,
             resume: Path | None = None, more: tuple[str, ...] = ()) -> subprocess.Popen:
    folder.mkdir(parents=True)
    command = [sys.executable, __file__, "--trainer", "--dir", str(folder), "--connect", ",".join(addresses),
               "--share", share, "--checkpoint-every", str(args.checkpoint_every), "--trainer-id", "real-run", *more]
    if resume is not None:
        command += ["--resume", str(resume)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=open(folder / "stderr.txt", "w"))


def _rows_logged(folder: Path) -> int:
    log = folder / "rows.bin"
    return log.stat().st_size // ROW_BYTES if log.exists() else 0


def _rows(path: Path, count: int | None = None) -> np.ndarray:
    data = np.fromfile(path, "<i8").reshape(-1, 2)
    return data if count is None else data[:count]


def run(args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    flags = producer_flags(args.batch, image_size=args.image_size, workers=1, seed=11, shard="auto", epochs=1,
                           trainer_timeout=5, mode="eval") + ["--epoch-order", "2"]
    producers = [launch_producer(data, flags) for _ in range(args.producers)]
    try:
        addresses = [p.endpoint for p in producers]
        started = time.perf_counter()
        a_dir = work / "a"
        a = _trainer(a_dir, addresses, args, "0/1",
                     more=("--pause-at-rows", str(args.records // 4), "--die-at-rows", str(args.records // 2)))
        assert a.stdout is not None and a.stdin is not None
        if a.stdout.readline().strip() != "paused":  # A's first 25%, or its death (then its stderr says why)
            raise RuntimeError(f"trainer A exited ({a.wait(30)}) before 25% of the epoch: see {a_dir}/stderr.txt")
        producers[1].proc.send_signal(signal.SIGKILL)
        producers[1].proc.wait(30)
        producers[1] = launch_producer(data, flags, bind=addresses[1])
        a.stdin.write("go\n")
        a.stdin.flush()
        if a.wait(WAIT_S) != -signal.SIGKILL:
            raise RuntimeError(f"trainer A exited {a.returncode}, not SIGKILLed at 50%: see {a_dir}/stderr.txt")
        a_s = time.perf_counter() - started
        a_rows = _rows_logged(a_dir)
        saved = sorted(a_dir.glob("ckpt-*.json"))
        if not saved:
            raise RuntimeError("trainer A saved no checkpoint before 50%: lower --checkpoint-every")
        last = json.loads(saved[-1].read_text())
        state = (a_dir / f"ckpt-{last['step']:08d}.state").read_bytes()

        from stoker.consumer.exact.state import merge_states
        merge_started = time.perf_counter()
        job = merge_states([state])
        merge_s = time.perf_counter() - merge_started
        (work / "job.state").write_bytes(job)
        resumed_at = time.perf_counter()
        ranks = [_trainer(work / f"r{r}", addresses, args, f"{r}/2", work / "job.state") for r in range(2)]
        for r in ranks:
            if r.wait(WAIT_S) != 0:
                raise RuntimeError(f"a resumed rank exited {r.returncode}: see {work}/r*/stderr.txt")
        b_s = time.perf_counter() - resumed_at
        wall = time.perf_counter() - started
    finally:
        for p in producers:
            p.stop()
    done = [json.loads((work / f"r{r}" / "done.json").read_text()) for r in range(2)]
    counted = np.concatenate([_rows(a_dir / "rows.bin", last["rows"])] +
                             [_rows(work / f"r{r}" / "rows.bin") for r in range(2)])
    b_rows = len(counted) - last["rows"]
    counts = np.bincount(counted[counted[:, 0] == 0, 1], minlength=args.records)
    reserved = set(_rows(a_dir / "rows.bin")[last["rows"]:, 1].tolist())
    return {
        "records": args.records, "producers": args.producers, "batch": args.batch, "image_size": args.image_size,
        "checkpoint_every": args.checkpoint_every, "wall_s": wall,
        "trainer_a": {"seconds": a_s, "rows": a_rows, "images_per_s": a_rows / a_s, "checkpoint_step": last["step"],
                      "checkpointed_rows": last["rows"], "after_checkpoint_rows": a_rows - last["rows"]},
        "checkpoint_bytes": len(state), "job_state_bytes": len(job), "merge_s": merge_s,
        "resumed": {"seconds": b_s, "rows": b_rows, "images_per_s": b_rows / b_s,
                    "rows_per_rank": [d["rows"] for d in done], "restore_open_s": [d["open_s"] for d in done],
                    "first_batch_s": [d["first_batch_s"] for d in done]},
        "images_per_s": (a_rows + b_rows) / wall,
        "rows_not_epoch_0": int((counted[:, 0] != 0).sum()),
        "twice": int((counts > 1).sum()), "never": int((counts == 0).sum()),
        "served_again_of_after_checkpoint": int(sum(int(counts[i]) == 1 for i in reserved)),
    }


def _table(r: dict[str, Any]) -> str:
    a, b = r["trainer_a"], r["resumed"]
    lines = [
        f"exact real run, epoch order 2: {r['records']:,} records, {r['producers']} producers, batch {r['batch']}, "
        f"{r['image_size']} px",
        f"  trainer A (world 1)    {a['rows']:>10,} rows  {a['seconds']:7.1f} s  {a['images_per_s']:9,.0f} img/s  "
        f"(producer SIGKILLed at 25%, A SIGKILLed at 50%)",
        f"  checkpoint             step {a['checkpoint_step']}, {a['checkpointed_rows']:,} rows; "
        f"{r['checkpoint_bytes']:,} bytes (job state {r['job_state_bytes']:,} bytes, merged in "
        f"{r['merge_s'] * 1e3:.2f} ms)",
        f"  after the checkpoint   {a['after_checkpoint_rows']:,} rows by A, served again: "
        f"{r['served_again_of_after_checkpoint']:,}",
        f"  resumed on 2 ranks     {b['rows']:>10,} rows  {b['seconds']:7.1f} s  {b['images_per_s']:9,.0f} img/s  "
        f"(per rank {b['rows_per_rank']}; open with state {max(b['restore_open_s']):.3f} s, "
        f"first batch {max(b['first_batch_s']):.2f} s)",
        f"  whole run              {r['wall_s']:.1f} s, {r['images_per_s']:,.0f} img/s",
        f"  exactly once           twice {r['twice']}, never {r['never']} (rows of other epochs: "
        f"{r['rows_not_epoch_0']})",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--records", type=int, default=10**6)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--image-size", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=50, help="batches between checkpoints")
    parser.add_argument("--data", default=None, help="the dataset folder, built there if missing "
                        "(default: a folder in the temporary directory named by the record count)")
    add_out_argument(parser, "exact_real_run.json")
    # the trainer process's own arguments (the script runs itself)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    for name in ("--dir", "--connect", "--share", "--resume", "--trainer-id"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--pause-at-rows", "--die-at-rows"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer_main(args)
        return
    data = Path(args.data or Path(tempfile.gettempdir()) / f"stoker-real-run-{args.records}")
    build_s = build_dataset(data, args.records)
    with tempfile.TemporaryDirectory() as work:
        result = run(args, data, Path(work))
    result.update(build_s=build_s, machine=machine_info())
    print(_table(result))
    write_results(args.out, result)
    if result["twice"] or result["never"]:
        sys.exit(f"exactly-once broken: {result['twice']} records twice, {result['never']} never")


if __name__ == "__main__":
    main()
