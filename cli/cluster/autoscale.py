"""``stoker cluster --autoscale``: the pool follows the job's summed need, read from the trainers' metrics.

Each interval the controller scrapes every trainer's Prometheus endpoint (``TrainerScraper``: a bounded timeout and
a bounded read, parsed with prometheus_client's text parser), sums ``stoker_trainer_producers_needed``
(fractional, headroom included: ``consumer/sizing``) over the trainers that know theirs, and rounds the sum ONCE
with one ``SizingPolicy``: up at once, down only after the policy's hold, so 16 trainers needing 0.3 each ask for
5 producers, not 16. ``Autoscaler.step`` returns a ``Decision`` (the policy's inputs and its answer), which the
caller logs and acts on (``scaled_pool.ScaledPool``).

A trainer that cannot be read (down, slow, garbage) is logged and its last reading kept for ``stale_after_s``,
then left out of the sum: one restarting trainer neither crashes the loop nor, at once, shrinks the pool. With no
trainer known, the sum is None and the policy's answer stands.
"""

from __future__ import annotations

import http.client
import math
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from stoker.consumer.sizing import PRODUCERS_NEEDED_METRIC
from stoker.consumer.sizing.policy import SizingPolicy

#: A metrics page larger than this is refused (a trainer's page is a few KB).
MAX_METRICS_BYTES = 1 << 20
#: The page is read this much at a time, the scrape's deadline checked between reads.
READ_CHUNK_BYTES = 64 << 10
#: The only URLs read: a trainer's ``--metrics-port`` endpoint (urllib would also open file:// and ftp://).
METRICS_SCHEMES = ("http", "https")
DEFAULT_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_STALE_AFTER_S = 30.0


class ScrapeError(RuntimeError):
    """One trainer's metrics could not be read or parsed; the message names the URL and why."""


def check_metrics_url(url: str) -> str:
    """``url`` if it is http:// or https:// with a host; ValueError naming the fix otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in METRICS_SCHEMES or not parts.netloc:
        raise ValueError(f"metrics URL {url!r} (--autoscale-metrics): only http:// or https:// URLs are read, a trainer's `--metrics-port` "
                         f"endpoint (e.g. http://HOST:9400/metrics)")
    return url


def scrape_needed(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Optional[float]:
    """``stoker_trainer_producers_needed`` on the page at ``url``; None where the trainer does not know it yet (the
    gauge is left out until it does). ScrapeError if the URL is not http(s), the page cannot be fetched, is too
    large, or does not parse, or the value is not a finite number >= 0.

    Time: connecting and the response's headers are bounded per socket operation (``timeout_s`` each: urllib has
    no whole-request deadline); the body is read in chunks until ``timeout_s`` from the start, so a page that
    trickles in costs at most ``timeout_s`` plus one socket operation."""
    try:
        check_metrics_url(url)
    except ValueError as exc:
        raise ScrapeError(str(exc)) from exc
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (http(s) only, checked)
            body = _read_bounded(url, response, deadline)
    except (OSError, ValueError) as exc:
        raise ScrapeError(f"{url}: cannot read the trainer's metrics ({exc}); is `--metrics-port` set on it and the "
                          "address reachable from here?") from exc
    try:
        families = list(text_string_to_metric_families(body.decode("utf-8")))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ScrapeError(f"{url}: not Prometheus text format ({exc})") from exc
    for family in families:
        for sample in family.samples:
            if sample.name == PRODUCERS_NEEDED_METRIC:
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    raise ScrapeError(f"{url}: {PRODUCERS_NEEDED_METRIC} is {value}, not a finite number >= 0")
                return value
    return None


def _read_bounded(url: str, response: http.client.HTTPResponse, deadline: float) -> bytes:
    """The body, at most ``MAX_METRICS_BYTES``, read before ``deadline`` (checked between chunks); ScrapeError
    otherwise. ``read1``: at most one socket read per chunk, so a trickle cannot stretch one chunk."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise ScrapeError(f"{url}: the metrics page was still arriving at the scrape's deadline; is the trainer "
                              "overloaded, or is this not a trainer's /metrics?")
        chunk = response.read1(READ_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_METRICS_BYTES:
            raise ScrapeError(f"{url}: the metrics page is over {MAX_METRICS_BYTES} bytes; is this a trainer's "
                              "/metrics?")


@dataclass(frozen=True)
class Decision:
    """One pass of the loop: each trainer's need (None: not known; ``errors``: why not read this time), their
    sum, the pool's size now and the policy's answer (None: no reading yet, nothing to do)."""

    at: float
    needs: Mapping[str, Optional[float]]
    errors: Mapping[str, str]
    total: Optional[float]
    current: int
    desired: Optional[int]

    @property
    def target(self) -> int:
        """What the pool should have after this decision: the answer, or the size it has while there is none."""
        return self.current if self.desired is None else self.desired

    def line(self) -> str:
        """The log line a person checks the decision by."""
        needs = ", ".join(f"{url} {'?' if need is None else f'{need:.2f}'}" for url, need in self.needs.items())
        total = "unknown" if self.total is None else f"{self.total:.2f}"
        move = ("no reading yet, size stands" if self.desired is None else
                f"scale up to {self.desired}" if self.desired > self.current else
                f"scale down to {self.desired}" if self.desired < self.current else "hold")
        return f"autoscale: needed sum {total} ({needs}); pool {self.current}, desired {self.target}: {move}"


class TrainerScraper:
    """The last need read from each trainer, kept ``stale_after_s`` past a failed read (see the module doc)."""

    def __init__(self, urls: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = print) -> None:
        if not urls:
            raise ValueError("the autoscaler needs at least one trainer metrics URL")
        self.urls = [check_metrics_url(url) for url in urls]
        self.timeout_s, self.stale_after_s = timeout_s, stale_after_s
        self._clock, self._log = clock, log
        self._last: dict[str, tuple[float, Optional[float]]] = {}  # url -> (read at, need)

    def read(self) -> tuple[dict[str, Optional[float]], dict[str, str]]:
        """Each trainer's need now (a recent one where this read failed) and the errors of this read."""
        needs: dict[str, Optional[float]] = {}
        errors: dict[str, str] = {}
        for url in self.urls:
            now = self._clock()
            try:
                self._last[url] = (now, scrape_needed(url, self.timeout_s))
            except ScrapeError as exc:
                errors[url] = str(exc)
                kept = self._last.get(url)
                fresh = kept is not None and now - kept[0] <= self.stale_after_s
                self._log(f"autoscale: {exc}; " + (f"keeping its last reading ({now - kept[0]:.0f} s old)" if fresh
                                                    else "left out of the sum"))
                if not fresh:
                    self._last.pop(url, None)
            kept = self._last.get(url)
            needs[url] = kept[1] if kept is not None else None
        return needs, errors


class Autoscaler:
    """The scraper and one policy over the job's summed need; ``step(current)`` decides, the caller acts."""

    def __init__(self, scraper: TrainerScraper, policy: SizingPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scraper, self.policy, self._clock = scraper, policy, clock
        self.last: Optional[Decision] = None

    def step(self, current: int) -> Decision:
        """Scrape, sum the known needs, round once; the decision (also kept as ``last``)."""
        needs, errors = self.scraper.read()
        known = [need for need in needs.values() if need is not None]
        total = sum(known) if known else None
        desired = self.policy.decide(total)
        self.last = Decision(self._clock(), needs, errors, total, current, desired)
        return self.last
