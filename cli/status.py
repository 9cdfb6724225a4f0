"""``stoker status``: live rates of producers and trainers from their Prometheus endpoints.

Scrapes every ``--metrics`` URL twice, ``interval`` seconds apart, and prints one
row per producer (images/s sent, records skipped, where its time goes) and per
trainer (batches/s received, queue occupancy, rejected messages, connected
producers, and the producers it needs where it has estimated them), then one sentence on which side is the
bottleneck, and the producers the job needs: the trainers' fractional needs summed, rounded up once. A URL that does
not answer (a producer that left an elastic pool) is a row marked ``down``; the
others are still shown.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from stoker.cli.argument_parser import HelpFormatter
from stoker.cli.exit_codes import EXIT_FAILURE, EXIT_OK, EXIT_SOME_DOWN
from stoker.consumer.sizing import PRODUCERS_NEEDED_METRIC

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class ScrapeError(RuntimeError):
    """A metrics URL could not be read; the message names it."""


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """All samples at ``url`` as ``{(name, sorted label items): value}``."""
    import urllib.error  # these when a command scrapes, not at every command's start
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise ScrapeError(f"cannot read {url}: {exc}; is --metrics-port set on that producer or trainer?") from None
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _gauge(samples: Samples, name: str) -> Optional[float]:
    """A label-less gauge's value, or None where the URL does not export it (not known yet, or an older trainer)."""
    values = [v for (n, _), v in samples.items() if n == name]
    return values[0] if values else None


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, val) in ls for k, val in labels.items()))


@dataclass
class StatusRow:
    url: str
    kind: str  # "producer", "trainer", "unknown" (no stoker metrics) or "down" (did not answer: text says why)
    text: str
    rate: float  # images/s
    occupancy: float = 0.0
    needed: Optional[float] = None  # a trainer's fractional need of producers (consumer/sizing), where known
    pool: int = 0  # the producers a trainer's pool has


def _scrape_all(urls: Sequence[str], down: dict[str, str]) -> dict[str, Samples]:
    """Each URL's samples; a URL that cannot be read goes into ``down`` with why (and is not asked again)."""
    samples = {}
    for u in urls:
        if u in down:
            continue
        try:
            samples[u] = scrape(u)
        except ScrapeError as exc:
            down[u] = str(exc)
    return samples


def status_rows(urls: Sequence[str], interval: float) -> list[StatusRow]:
    """A row per URL, in order; a URL that could not be read at either scrape is a ``"down"`` row saying why
    (in an elastic pool a producer that left is one of these: the others are still shown)."""
    down: dict[str, str] = {}
    before = _scrape_all(urls, down)
    time.sleep(interval)
    after = _scrape_all(urls, down)
    rows = []
    for u in urls:
        if u in down:
            rows.append(StatusRow(u, "down", down[u], 0.0))
            continue
        a, b = before[u], after[u]
        if any(n.startswith("stoker_producer_") for n, _ in b):
            images = (_sum(b, "stoker_producer_images_sent_total") - _sum(a, "stoker_producer_images_sent_total"))
            rate = images / interval
            stages = {s: _sum(b, "stoker_producer_stage_seconds_total", stage=s)
                      - _sum(a, "stoker_producer_stage_seconds_total", stage=s)
                      for s in ("fetch", "read", "decode", "augment", "serialize", "send")}
            busiest = max(stages, key=stages.get) if any(stages.values()) else "-"
            storage = int(_sum(b, "stoker_producer_storage_waiting"))  # workers whose storage calls fail now
            rows.append(StatusRow(u, "producer", f"{rate:8.1f} img/s  skipped {int(_sum(b, 'stoker_producer_records_skipped_total'))}"
                                  f"  workers {int(_sum(b, 'stoker_producer_workers_alive'))}  most time in: {busiest}"
                                  + (f"  WAITING ON OBJECT STORAGE ({storage} worker(s); see its log)" if storage else ""),
                                  rate))
        elif any(n.startswith("stoker_trainer_") for n, _ in b):
            images = _sum(b, "stoker_trainer_images_received_total") - _sum(a, "stoker_trainer_images_received_total")
            occupancy = _sum(b, "stoker_trainer_queue_occupancy")
            rejected = _sum(b, "stoker_trainer_protocol_errors_total") + _sum(b, "stoker_trainer_mismatched_batches_total")
            stuck = _sum(b, "stoker_trainer_producers_stuck_total") + _sum(b, "stoker_trainer_stall_warnings_total")
            liveness = (f"  stuck producers {int(stuck)} (splits re-served "
                        f"{int(_sum(b, 'stoker_trainer_splits_reserved_total'))}, records wasted "
                        f"{int(_sum(b, 'stoker_trainer_wasted_records_total'))})" if stuck else "")
            needed = _gauge(b, PRODUCERS_NEEDED_METRIC)
            sizing = ("" if needed is None else f"  needs {needed:.2f} producers (demand "
                      f"{_sum(b, 'stoker_trainer_demand_images_per_s'):.0f} img/s, a producer "
                      f"{_sum(b, 'stoker_trainer_producer_capacity_images_per_s'):.0f} img/s)")
            rows.append(StatusRow(u, "trainer", f"{images / interval:8.1f} img/s  queue {occupancy:.2f}  rejected "
                                  f"{int(rejected)}  producers connected {int(_sum(b, 'stoker_trainer_connected_producers'))}"
                                  + liveness + sizing, images / interval, occupancy, needed,
                                  int(_sum(b, "stoker_trainer_pool_producers"))))
        else:
            rows.append(StatusRow(u, "unknown", "no stoker metrics at this URL", 0.0))
    return rows


def verdict(rows: Sequence[StatusRow]) -> str:
    trainers = [r for r in rows if r.kind == "trainer"]
    if not trainers:
        return ("no trainer among the URLs that answered: add the trainer's --metrics-port URL to see the "
                "bottleneck")
    occupancy = sum(r.occupancy for r in trainers) / len(trainers)
    if occupancy < 0.2:
        return f"input-bound (queue {occupancy:.2f}): add producers or workers"
    if occupancy > 0.6:
        return f"training-bound (queue {occupancy:.2f}): producers keep up"
    return f"balanced (queue {occupancy:.2f})"


def print_status(urls: Sequence[str], interval: float) -> list[StatusRow]:
    """Print a row per URL (those that did not answer marked ``down``) and the verdict; return the rows.

    ScrapeError when no URL answered: there is nothing to show but the reasons, which its message gives."""
    rows = status_rows(urls, interval)
    if all(r.kind == "down" for r in rows):
        raise ScrapeError("no metrics URL answered: " + "; ".join(r.text for r in rows))
    width = max(len(r.url) for r in rows)
    for r in rows:
        print(f"{r.kind:<8} {r.url:<{width}}  {r.text}")
    down = sum(r.kind == "down" for r in rows)
    print(f"bottleneck: {verdict(rows)}" + (f" ({down} of {len(rows)} URL(s) down)" if down else ""))
    pool = pool_line(rows)
    if pool:
        print(pool)
    return rows


def pool_line(rows: Sequence[StatusRow]) -> str:
    """The job's producer count: the trainers' fractional needs summed, rounded up once (``consumer/sizing``)."""
    needs = [r.needed for r in rows if r.kind == "trainer" and r.needed is not None]
    if not needs:
        return ""
    total = sum(needs)
    pool = max((r.pool for r in rows if r.kind == "trainer"), default=0)
    return (f"pool: {math.ceil(total - 1e-9)} producers needed (the sum of {len(needs)} trainer(s)' needs, "
            f"{total:.2f}, rounded up once); the pool has {pool}")


def add_status_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", common: argparse.ArgumentParser) -> None:
    """``stoker status``."""
    st = sub.add_parser("status", parents=[common], formatter_class=HelpFormatter, help="live rates and queue occupancy",
                        description="Scrape the Prometheus endpoints of producers and trainers (their "
                        "--metrics-port) twice and show each one's live rate, the trainer's queue occupancy, and "
                        "which side is the bottleneck. A URL that does not answer (a producer that left the pool) is "
                        "shown as down. Exit code: 0 every URL answered; 3 some answered (shown) and the rows "
                        "marked down did not; 1 none answered; 2 bad usage.")
    st.add_argument("--metrics", required=True,
                    help="comma-separated metrics URLs, e.g. hostA:9100,hostB:9100,trainer:9200")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between the two scrapes")
    st.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        rows = print_status([u.strip() for u in args.metrics.split(",") if u.strip()], args.interval)
    except ScrapeError as exc:
        print(f"stoker status: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_SOME_DOWN if any(r.kind == "down" for r in rows) else EXIT_OK
