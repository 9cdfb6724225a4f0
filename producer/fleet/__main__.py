"""One fleet process: ``python -m stoker.producer.fleet --first F --count C --of N [...]`` (launcher.py starts these).

Serves endpoints ``F .. F+C-1`` of a fleet of ``N`` until SIGTERM or SIGINT, or until its parent is gone
(``--parent-pid``: checked every half second, so a launcher killed outright leaves no fleet behind).
Exit codes: 0 stopped, 2 bad flags, 1 anything that kept it from serving (the message says what).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from stoker.producer.fleet.fleet import FleetConfig, ProducerFleet


def parse_config(argv: Optional[Sequence[str]] = None) -> tuple[FleetConfig, Optional[int]]:
    """The settings and ``--parent-pid``; exits 2 with usage for flags that are not valid."""
    parser = argparse.ArgumentParser(prog="python -m stoker.producer.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--first", type=int, default=0, help="the first endpoint's shard (default 0)")
    parser.add_argument("--count", type=int, required=True, help="endpoints in this process")
    parser.add_argument("--of", type=int, help="endpoints in the whole fleet: each serves shard I/OF (default: count)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--base-port", type=int, default=0, help="endpoint I binds BASE+I (default 0: any free port)")
    parser.add_argument("--records", type=int, default=1024, help="records per endpoint's shard (default 1024)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exact", action="store_true", help="exact mode: each endpoint a fixed shard I/OF")
    parser.add_argument("--pool", action="store_true", help="exact mode: every endpoint a producer of one elastic "
                        "pool (--shard auto) over all records x OF")
    parser.add_argument("--epoch-order", type=int, default=0, choices=(0, 1, 2),
                        help="a pool's epoch order (default 0: as a daemon chooses)")
    parser.add_argument("--epochs", type=int, help="exact epochs to serve, then stop serving (default: endless)")
    parser.add_argument("--status-file", help="JSON lines for programs, as a daemon's (serve/status_file.py)")
    parser.add_argument("--parent-pid", type=int, help="stop when this process is gone")
    args = parser.parse_args(argv)
    try:
        config = FleetConfig(first=args.first, count=args.count, of=args.of or args.first + args.count,
                             host=args.host, base_port=args.base_port, records=args.records,
                             batch_size=args.batch_size, image_size=args.image_size, seed=args.seed,
                             status_file=args.status_file,
                             exact=args.exact or args.pool or args.epochs is not None, epochs=args.epochs,
                             pool=args.pool, epoch_order=args.epoch_order)
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.parent_pid


def _stop_on_signals_or_orphaning(parent_pid: Optional[int]) -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if parent_pid is not None:
        def watch() -> None:
            while not stop.wait(0.5):
                if os.getppid() != parent_pid:
                    stop.set()
        threading.Thread(target=watch, name="stoker-fleet-parent-watch", daemon=True).start()
    return stop


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, parent_pid = parse_config(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = _stop_on_signals_or_orphaning(parent_pid)
    try:
        fleet = ProducerFleet(config)
    except (OSError, ValueError, RuntimeError) as exc:  # BindError is a RuntimeError
        print(f"fleet: {exc}", file=sys.stderr)
        return 1
    fleet.run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
