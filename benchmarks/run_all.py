#!/usr/bin/env python3
"""Run every benchmark of the throughput issue in one go; each prints its table and writes JSON.

    python benchmarks/run_all.py [--tensorpack-python /tmp/tpvenv/bin/python] [--skip link,soak]

Order: producer throughput (decoder limit, 1 and 2 workers), transport (protocol v1 vs
bare pyzmq), trainer latency hiding (constant / ZMQInput / feed_dict), peers (tf.data,
tensorpack), link (shaped veth links; needs root), soak (memory; about 3 minutes).
Results land in benchmarks/results/*.json; docs/performance.md explains them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = ["producer_throughput", "transport", "trainer_latency", "peers", "link", "soak"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    parser.add_argument("--tensorpack-python", default=None, help="passed to peers.py")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    failed = []
    for name in BENCHMARKS:
        if name in skip:
            continue
        extra = ["--tensorpack-python", args.tensorpack_python] if name == "peers" and args.tensorpack_python else []
        print(f"\n===== {name} =====", flush=True)
        if subprocess.run([sys.executable, str(HERE / f"{name}.py"), *extra]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
