"""Which producers a PULL socket is really connected to, and why a connection fails.

``ConnectionWatcher`` reads the socket's monitor events (the caller's thread only;
libzmq sockets are not thread-safe). A producer counts as connected once the ZMTP
handshake succeeded, not when TCP connected: a trainer without CurveZMQ keys
reaches a Curve producer over TCP and is then refused at every handshake. Each
handshake failure is counted and explained in words a user can act on
(``explain_handshake_failure``), so a timeout can say "the producer requires
CurveZMQ" rather than "check the producers run".

libzmq drops an endpoint for good after a protocol error (a failed handshake, a
message over ``MAXMSGSIZE``); the watcher re-connects such an endpoint once it
has been disconnected for ``revive_after`` seconds with no retry under way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from stoker.consumer.receive.errors import ADVICE_CURVE_KEYS, ADVICE_HUNG_UP, ADVICE_MODE_MISMATCH

log = logging.getLogger("stoker.consumer")

MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
                  | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_REVIVE_LOG_EVERY_S = 60.0


def explain_handshake_failure(event: int, value: int, curve: bool) -> str:
    """What a failed ZMTP handshake most likely means for a Stoker trainer, and how to fix it.

    ``event``/``value`` are a libzmq monitor event and its value (protocol error code,
    ZAP status or errno); ``curve`` says whether this trainer uses CurveZMQ keys.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the producer refused this trainer's CurveZMQ key (ZAP status {value}): copy this trainer's public "
                "key file (NAME.key, not NAME.key_secret) into the producer's --curve-authorized-keys folder")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        if curve:
            return ("this trainer uses CurveZMQ but the producer does not: start the producer with "
                    "--curve-secret-key and --curve-authorized-keys, or drop the trainer's keys")
        return f"the producer requires CurveZMQ and this trainer has no keys: {ADVICE_CURVE_KEYS}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_INVALID_METADATA:
        return ADVICE_MODE_MISMATCH  # the socket types cannot talk: a plain trainer and an exact producer, or the reverse
    if curve:
        return ("the producer broke off the CurveZMQ handshake: most likely the trainer's server key "
                "(--curve-server-key) is not that producer's public key")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # The same mismatch as above when the producer hangs up before we read its greeting (a race).
        return f"the producer broke off the handshake: {ADVICE_HUNG_UP}"
    return f"the ZMTP handshake failed (libzmq event {event:#x}, value {value:#x}): is that address a Stoker producer?"


def _is_definitive(event: int, value: int) -> bool:
    """Failures that name their cause; a hang-up (NO_DETAIL) only suggests one."""
    return event == zmq.EVENT_HANDSHAKE_FAILED_AUTH or (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)


@dataclass
class HandshakeFailures:
    """Failed handshakes so far: how many, and the latest endpoint and explanation."""

    count: int = 0
    endpoint: str = ""
    reason: str = ""


class ConnectionHealth:
    """The health of a set of producer connections, kept the same way by every transport; thread-safe.

    Counts failed handshakes with the latest endpoint and explanation (``failures``), and per endpoint the
    handshakes refused in a row for a mode mismatch (``mode_mismatches``; never for an endpoint that once
    completed a handshake: a producer shutting down also hangs up early), and re-connects.
    """

    def __init__(self) -> None:
        self.failures = HandshakeFailures()
        self.mode_mismatches: dict[str, int] = {}
        self.reconnects = 0
        self._handshaken: set[str] = set()
        self._certain: set[str] = set()  # endpoints whose failure cause is known for sure
        self._lock = threading.Lock()

    def succeeded(self, endpoint: str) -> None:
        """A handshake with ``endpoint`` succeeded: it speaks our mode."""
        with self._lock:
            self._handshaken.add(endpoint)
            self.mode_mismatches.pop(endpoint, None)

    def failed(self, endpoint: str, reason: str, mode_mismatch: bool = False, certain: Optional[bool] = None) -> int:
        """A failed handshake; the failures so far. ``certain``: True, a cause known for sure (kept over guesses);
        False, a guess (replaces no sure cause of that endpoint); None, always the latest."""
        with self._lock:
            f = self.failures
            f.count += 1
            if certain is not False or endpoint not in self._certain:
                f.endpoint, f.reason = endpoint, reason
            if certain:
                self._certain.add(endpoint)
            if mode_mismatch and endpoint not in self._handshaken:
                self.mode_mismatches[endpoint] = self.mode_mismatches.get(endpoint, 0) + 1
            return f.count

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool: its refusals no longer count."""
        with self._lock:
            self.mode_mismatches.pop(endpoint, None)

    def summary(self) -> tuple[int, str, str]:
        """``(failed handshakes, last endpoint, why)``."""
        with self._lock:
            return self.failures.count, self.failures.endpoint, self.failures.reason

    def mismatches(self) -> dict[str, int]:
        with self._lock:
            return dict(self.mode_mismatches)


class ConnectionWatcher:
    """Tracks connected producers and failed handshakes of one socket; see the module doc.

    Connects ``sock`` to ``addresses`` itself, after its monitor is running: an event
    emitted before the monitor exists is lost, and a handshake missed that way would
    leave exact mode waiting forever for a connection it never saw. Raises
    ``zmq.ZMQError`` for an address libzmq cannot parse.
    """

    def __init__(self, sock: zmq.Socket, addresses: Sequence[str], curve: bool, revive_after: float = 1.0) -> None:
        self.sock = sock
        self.addresses = list(addresses)
        self.curve = curve
        self.revive_after = revive_after
        self.monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        self.connected: set[str] = set()
        self.handshakes = 0  # successful ones: each is a new connection (exact mode says hello on it)
        self.health = ConnectionHealth()
        self._tcp_only: set[str] = set()  # connected over TCP, no ZMTP handshake yet
        self._disconnected_at: dict[str, float] = {}
        self._revive_logged_at: dict[str, float] = {}
        self._removed: set[str] = set()  # endpoints that left the pool
        try:
            for address in self.addresses:
                sock.connect(address)
        except zmq.ZMQError:
            self.close()
            raise

    def add(self, address: str) -> None:
        """Connect to one more producer (it joined the pool); zmq.ZMQError if libzmq cannot parse it."""
        if address not in self.addresses:
            self.sock.connect(address)
            self.addresses.append(address)
            self._removed.discard(address)

    def remove(self, address: str) -> None:
        """Disconnect from a producer that left the pool; what it had sent and is queued stays."""
        if address in self.addresses:
            self.addresses.remove(address)
            self._removed.add(address)
            try:
                self.sock.disconnect(address)
            except zmq.ZMQError:
                pass  # libzmq had already dropped it
            self.connected.discard(address)
            self._disconnected_at.pop(address, None)
            self.health.forget(address)

    def poll(self) -> bool:
        """Handle pending monitor events and revive dropped endpoints; True if anything changed."""
        changed = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind, value = event["event"], event["value"]
            endpoint = event["endpoint"].decode(errors="replace")
            if endpoint in self._removed:
                continue  # an event from before it left the pool
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected.add(endpoint)
                self.handshakes += 1
                self._tcp_only.discard(endpoint)
                self._disconnected_at.pop(endpoint, None)
                self.health.succeeded(endpoint)
            elif kind in _HANDSHAKE_FAILED:
                self._tcp_only.discard(endpoint)
                # A hang-up races with the greeting and only suggests a cause: it never replaces a known one.
                mismatch = (kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                            and value == zmq.PROTOCOL_ERROR_ZMTP_INVALID_METADATA)
                if self.health.failed(endpoint, explain_handshake_failure(kind, value, self.curve), mismatch,
                                      certain=_is_definitive(kind, value)) == 1:
                    log.warning("handshake with %s failed: %s", endpoint, self.health.failures.reason)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected.discard(endpoint)
                self._disconnected_at[endpoint] = time.monotonic()
                if endpoint in self._tcp_only:  # closed on us before any handshake event: wrong socket type
                    self._tcp_only.discard(endpoint)
                    self.health.failed(endpoint, ADVICE_MODE_MISMATCH, mode_mismatch=True)
            elif kind in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECTED):
                self._disconnected_at.pop(endpoint, None)  # libzmq is retrying by itself
                if kind == zmq.EVENT_CONNECTED:
                    self._tcp_only.add(endpoint)
            changed = True
        self._revive()
        return changed

    def _revive(self) -> None:
        now = time.monotonic()
        for endpoint, since in list(self._disconnected_at.items()):
            if now - since <= self.revive_after or endpoint not in self.addresses:
                continue
            del self._disconnected_at[endpoint]
            try:
                self.sock.disconnect(endpoint)
            except zmq.ZMQError:
                pass  # already forgotten by libzmq
            self.sock.connect(endpoint)
            self.health.reconnects += 1
            if now - self._revive_logged_at.get(endpoint, -_REVIVE_LOG_EVERY_S) >= _REVIVE_LOG_EVERY_S:
                self._revive_logged_at[endpoint] = now
                log.warning("re-connecting to %s: libzmq dropped it after a protocol error (a failed handshake or a "
                            "message over max_message_bytes); %d re-connects so far", endpoint, self.health.reconnects)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
