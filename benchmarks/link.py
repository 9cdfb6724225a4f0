#!/usr/bin/env python3
"""Over a real link: producers on separate network-namespace hosts, links shaped with tc tbf.

For each rate (default 1gbit and 10gbit) a LocalCluster puts one producer in its own
namespace behind a veth link shaped to that rate; the producer serves pre-decoded
batches as fast as it can (--repeat-batches), so the link is the only limit; this
process (the trainer side) receives and validates for a few seconds. Reports
delivered payload bytes/s as a fraction of the link rate. Needs root and iproute2.

Run:  sudo python benchmarks/link.py [--rates 1gbit,10gbit]   (table + JSON)
"""

from __future__ import annotations

import re

from harness import (add_out_argument, benchmark_parser, launch_producer, producer_flags, synthetic_lmdb,
                     write_results)
from stoker.cli.cluster.local_cluster import LocalCluster
from stoker.consumer.train.throughput import measure_link

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def bits_per_s(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not match:
        raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 500mbit")
    return float(match.group(1)) * UNITS[match.group(2)]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    add_out_argument(parser, "link.json")
    args = parser.parse_args()
    rows = []
    with synthetic_lmdb(64) as lmdb_path:
        for rate in args.rates.split(","):
            with LocalCluster(1, rate=rate, trainer_namespace=False) as cluster:
                host = cluster.hosts[0]
                flags = producer_flags(args.batch_size, args.image_size, repeat_batches=True)
                with launch_producer(lmdb_path, flags, bind=f"tcp://{host.address}:5555",
                                     command_prefix=host.command([])) as producer:
                    measured = measure_link([producer.endpoint], seconds=args.seconds)
            link_bytes = bits_per_s(rate) / 8
            rows.append({"rate": rate, "delivered_mb_per_s": measured.mb_per_s,
                         "link_mb_per_s": link_bytes / 1e6, "fraction_of_link": measured.mb_per_s * 1e6 / link_bytes,
                         "images_per_s": measured.images_per_s})
    print(f"one producer host -> trainer over a veth link shaped with tc tbf, {args.batch_size}x{args.image_size}px batches:")
    print(f"{'link':<8} | {'link MB/s':>9} | {'delivered MB/s':>14} | {'fraction':>8} | {'images/s':>8}")
    print("-" * 60)
    for r in rows:
        print(f"{r['rate']:<8} | {r['link_mb_per_s']:>9.0f} | {r['delivered_mb_per_s']:>14.0f} | "
              f"{r['fraction_of_link']:>8.3f} | {r['images_per_s']:>8.0f}")
    write_results(args.out, {"benchmark": "link", "rows": rows})


if __name__ == "__main__":
    main()
