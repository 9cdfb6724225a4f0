#!/usr/bin/env python3
"""Run every benchmark in one go; each prints its table and writes JSON.

    python benchmarks/run_all.py [--tensorpack-python /tmp/tpvenv/bin/python] [--skip link,soak]

Order: decoders (OpenCV / simplejpeg / PyTurboJPEG / crop-window, reduced DCT), producer
throughput (decoder limit, 1 and 2 workers), pipeline overhead (the imagenet path through the
pipeline interface vs the loop before it), user pipeline scaling (a pure-Python transform on 1
and 2 workers), transport (protocol v1 vs bare pyzmq), trainer ingest (ZMQInput vs a bare
receive loop), exact cost (exact mode vs plain PUSH/PULL, input state size), hello bytes (what one
trainer's hellos send its producers, old format against new),
trainer latency hiding (constant / ZMQInput / feed_dict), peers (tf.data, tensorpack),
link (shaped veth links; needs root), soak (memory over 20,000 batches; about 3
minutes) and soak_full_queue (memory with 9.6 MB batches and a full queue; 2 minutes).
Results land in benchmarks/results/*.json; docs/performance.md explains them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import benchmark_parser

HERE = Path(__file__).parent
#: name -> (script, extra arguments)
BENCHMARKS = {
    "decoders": ("decoders", []),
    "producer_throughput": ("producer_throughput", []),
    "pipeline_overhead": ("pipeline_overhead", []),
    "user_pipeline_scaling": ("user_pipeline_scaling", []),
    "transport": ("transport", []),
    "trainer_ingest": ("trainer_ingest", []),
    "exact_cost": ("exact_cost", []),
    "hello_bytes": ("hello_bytes", []),
    "elastic": ("elastic", []),
    "trainer_latency": ("trainer_latency", []),
    "peers": ("peers", ["--batches", "150"]),
    "link": ("link", []),
    "soak": ("soak", []),
    "soak_full_queue": ("soak", ["--batch-size", "64", "--image-size", "224", "--batches", "600", "--warmup", "100",
                                 "--step-ms", "100", "--out", str(HERE / "results" / "soak_full_queue.json")]),
}


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    parser.add_argument("--tensorpack-python", default=None, help="passed to peers.py")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    failed = []
    for name, (script, extra) in BENCHMARKS.items():
        if name in skip:
            continue
        if name == "peers" and args.tensorpack_python:
            extra = [*extra, "--tensorpack-python", args.tensorpack_python]
        print(f"\n===== {name} =====", flush=True)
        if subprocess.run([sys.executable, str(HERE / f"{script}.py"), *extra]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
