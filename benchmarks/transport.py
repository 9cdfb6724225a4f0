#!/usr/bin/env python3
"""Transport: protocol v1 vs bare pyzmq, same bytes, tcp://127.0.0.1, another process.

A sender process PUSHes 9.6 MB batches (uint8 [64,224,224,3] + int32 [64]) as fast
as it can; this process PULLs them. "bare" sends the raw buffers with copy=False
and receives with copy=False; "stoker" encodes with stoker.protocol (send
copy=False) and decodes every message (validation + np.frombuffer). Also checks
that the decoded array shares memory with the received frame (zero copies).

Run:  python benchmarks/transport.py [--batches 300]   (table + JSON)
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import zmq

from harness import add_out_argument, benchmark_parser, write_results
from stoker.protocol import decode_batch, encode_batch

SHAPE = (64, 224, 224, 3)


def sender(endpoint: str, mode: str, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(endpoint)
    images = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    labels = np.arange(SHAPE[0], dtype=np.int32)
    for seq in range(count):
        if mode == "bare":
            sock.send_multipart([images, labels], copy=False)
        else:
            sock.send_multipart(encode_batch({"images": images, "labels": labels}, producer="bench", seq=seq),
                                copy=False)
    sock.close(linger=-1)
    ctx.term()


def measure(mode: str, batches: int, warmup: int) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 4)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=sender, args=(f"tcp://127.0.0.1:{port}", mode, batches + warmup))
    proc.start()
    zero_copy = True
    nbytes = 0
    for i in range(batches + warmup):
        if i == warmup:
            t0, nbytes = time.perf_counter(), 0
        frames = sock.recv_multipart(copy=False)
        if mode == "bare":
            images = np.frombuffer(frames[0].buffer, np.uint8).reshape(SHAPE)
            nbytes += sum(len(f) for f in frames)
        else:
            batch = decode_batch(frames)
            images = batch["images"]
            nbytes += sum(len(f) for f in frames)
            zero_copy &= np.shares_memory(images, np.frombuffer(frames[1].buffer, np.uint8))
    seconds = time.perf_counter() - t0
    proc.join(30)
    sock.close(0)
    ctx.term()
    return {"mode": mode, "gb_per_s": nbytes / seconds / 1e9, "batches_per_s": batches / seconds,
            "zero_copy_decode": bool(zero_copy) if mode == "stoker" else None}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the best is kept")
    add_out_argument(parser, "transport.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"bare": [], "stoker": []}
    for _ in range(args.repeats):
        for mode in ("bare", "stoker"):
            runs[mode].append(measure(mode, args.batches, args.warmup))
    best = {mode: max(r, key=lambda x: x["gb_per_s"]) for mode, r in runs.items()}
    ratio = best["stoker"]["gb_per_s"] / best["bare"]["gb_per_s"]
    print(f"transport over tcp://127.0.0.1, {np.prod(SHAPE) / 1e6:.1f} MB batches, best of {args.repeats}:")
    print(f"{'mode':<22} | {'GB/s':>6} | {'batches/s':>9}")
    print("-" * 44)
    print(f"{'bare pyzmq copy=False':<22} | {best['bare']['gb_per_s']:>6.2f} | {best['bare']['batches_per_s']:>9.1f}")
    print(f"{'stoker protocol v1':<22} | {best['stoker']['gb_per_s']:>6.2f} | {best['stoker']['batches_per_s']:>9.1f}")
    print(f"ratio stoker / bare: {ratio:.3f}; decoded arrays view the received frames (zero copy): "
          f"{best['stoker']['zero_copy_decode']}")
    write_results(args.out, {"benchmark": "transport", "runs": runs, "best": best, "ratio": ratio})


if __name__ == "__main__":
    main()
