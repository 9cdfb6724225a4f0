"""Which producers a trainer reads from right now: the producer pool, found through the platform.

A trainer is given *producer sources*; ``ProducerPool`` turns them into endpoints and, every
``refresh_s`` seconds, into the endpoints that appeared and vanished since:

- ``tcp://10.0.0.5:5555`` (an IP address) or ``ipc://...``: that one producer, fixed.
- ``tcp://NAME:5555``: every address ``NAME`` resolves to is a producer, resolved again every
  ``refresh_s``. A Kubernetes *headless* Service returns one A record per ready pod, so
  ``tcp://stoker-producer.NAMESPACE.svc:5555`` follows ``kubectl scale`` with no registry of our
  own. IPv4 addresses are used when a name has any (``localhost`` also resolves to ``::1``, which
  a producer bound to ``0.0.0.0`` does not serve), IPv6 otherwise. A name that does not exist
  (a headless Service with no ready pod answers NXDOMAIN) means no producers; a failed lookup
  (DNS unreachable, timed out) keeps the last answer, so a DNS hiccup never drops a running pool.
- A callable returning addresses (Python API only): the user's own discovery (Consul, a file,
  a cloud API), called every ``refresh_s``; what it returns is resolved as above. If it raises,
  the last answer is kept and the error logged.

Changes are logged (what joined, what left). ``refresh_s=0`` resolves once and never again.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Callable, Optional
from urllib.parse import urlsplit

from stoker.consumer.receive.options import DEFAULT_REFRESH_S, AddressSource, check_source

log = logging.getLogger("stoker.consumer")

_ERROR_LOG_EVERY_S = 60.0


class NameNotFound(Exception):
    """The name does not exist (NXDOMAIN): no producers behind it right now."""


def _lookup(host: str, port: int) -> list[str]:
    """The IP addresses ``host`` resolves to (IPv4 when any); NameNotFound, or OSError for a failed lookup."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NameNotFound(host) from None
        raise
    v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
    return v4 or sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})


def is_literal(address: str) -> bool:
    """Whether ``address`` names one producer as it stands (an IP address, ``ipc://``, ``inproc://``)."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname:
        return True  # ipc://, inproc://, or something libzmq will judge (and refuse with its own message)
    try:
        ipaddress.ip_address(parts.hostname)
        return True
    except ValueError:
        return parts.hostname == "*"


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class ProducerPool:
    """The current producer endpoints behind some sources; see the module doc.

    ``endpoints`` is the set now; ``refresh()`` (cheap, never blocking) returns ``(joined, left)``
    since the last call. The first resolution happens in the constructor; later ones, with
    ``background`` (the default), on a thread of the pool's own, so a slow DNS server never stalls
    the caller (a trainer's receive loop, whose heartbeats keep producers from dropping it).
    ``describe()`` names the sources for messages; ``close()`` stops the thread.
    """

    def __init__(self, source: AddressSource, refresh_s: float = DEFAULT_REFRESH_S,
                 lookup: Callable[[str, int], list[str]] = _lookup, background: bool = True) -> None:
        if refresh_s < 0:
            raise ValueError(f"refresh every {refresh_s} s: give seconds >= 0 (0: resolve once)")
        self.source = check_source(source)
        self.refresh_s = refresh_s
        # Fixed for the pool's life; asked on every turn of a receive loop, so worked out once.
        self._dynamic = refresh_s != 0 and (callable(self.source) or not all(is_literal(a) for a in self.source))
        self._lookup = lookup
        self._answers: dict[str, list[str]] = {}  # name -> last good answer
        self._error_logged_at: dict[str, float] = {}
        self.lookups = 0
        self.endpoints: list[str] = self._resolve_all()
        self._latest = list(self.endpoints)  # the resolving thread's last answer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = time.monotonic() + refresh_s
        self._thread: Optional[threading.Thread] = None
        if background and self.dynamic:
            self._thread = threading.Thread(target=self._resolve_loop, name="stoker-discovery", daemon=True)
            self._thread.start()

    def _resolve_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            current = self._resolve_all()
            with self._lock:
                self._latest = current

    def close(self) -> None:
        """Stop resolving; waits up to 1 s for the thread (a lookup under way finishes on its own: a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)

    @property
    def dynamic(self) -> bool:
        """Whether the set can change (a name or a callable, and refreshing on)."""
        return self._dynamic

    def describe(self) -> str:
        """The sources as the user gave them (names, not the addresses they resolved to)."""
        if callable(self.source):
            return f"{getattr(self.source, '__name__', type(self.source).__name__)}()"
        return ", ".join(self.source)

    def refresh(self) -> tuple[list[str], list[str]]:
        """The endpoints that joined and left since the last call (resolving here only without a thread)."""
        if not self.dynamic:
            return [], []
        if self._thread is not None:
            with self._lock:
                current = list(self._latest)
        else:
            now = time.monotonic()
            if now < self._next:
                return [], []
            self._next = now + self.refresh_s
            current = self._resolve_all()
        joined = [e for e in current if e not in self.endpoints]
        left = [e for e in self.endpoints if e not in current]
        if joined or left:
            log.info("producer pool %s: %s joined, %s left (%d now)", self.describe(), joined or "none",
                     left or "none", len(current))
        self.endpoints = current
        return joined, left

    def _addresses(self) -> list[str]:
        if not callable(self.source):
            return list(self.source)
        try:
            got = list(self.source())
            return check_source(got) if got else []  # type: ignore[return-value]  # none: scaled to zero
        except Exception as exc:  # the user's discovery failed: keep what we had
            self._log_error("discovery", f"{exc!r}; keeping the {len(self.endpoints)} producer(s) known")
            return [e for e in self.endpoints]

    def _resolve_all(self) -> list[str]:
        out: list[str] = []
        for address in self._addresses():
            for endpoint in self._resolve(address):
                if endpoint not in out:
                    out.append(endpoint)
        return out

    def _resolve(self, address: str) -> list[str]:
        if is_literal(address):
            return [address]
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
        assert host is not None and port is not None
        self.lookups += 1
        try:
            ips = self._lookup(host, port)
        except NameNotFound:
            ips = []
        except OSError as exc:  # DNS unreachable or timed out: a running pool is not dropped for that
            self._log_error(host, f"lookup failed ({exc}); keeping its last answer "
                                  f"{self._answers.get(host, [])}")
            ips = self._answers.get(host, [])
        self._answers[host] = ips
        return [_endpoint(ip, port) for ip in ips]

    def _log_error(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._error_logged_at.get(key, -_ERROR_LOG_EVERY_S) >= _ERROR_LOG_EVERY_S:
            self._error_logged_at[key] = now
            log.warning("producer discovery, %s: %s", key, message)
