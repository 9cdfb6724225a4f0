"""Who failed to connect to a producer, and why: CurveZMQ refusals made visible.

A trainer that cannot talk to a Curve producer is refused inside libzmq, and
libzmq tells nobody. Two sources say so here:

- ``RefusalLoggingAuthenticator``: pyzmq's ZAP authenticator, plus a warning
  naming the peer's IP address and public key when a trainer's key is not
  authorised. ZAP requests carry the address, so these warnings name the peer.
- ``HandshakeFailureLog``: the PUSH socket's monitor events for handshakes that
  fail before ZAP is asked (a trainer without CurveZMQ, or one holding the wrong
  server key). libzmq's monitor reports only our bound endpoint for these, not
  the peer, so the warning says what failed and where we listen.

Warnings are rate-limited (per address for refusals) so a misconfigured trainer
that retries every 100 ms cannot flood the log; counts keep the full total.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("stoker.producer")

WARN_EVERY_S = 60.0
_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "broke off",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "not authorised",
}


class _RateLimit:
    """True at most once per ``every`` seconds per key."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def __call__(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -self.every) < self.every:
            return False
        self._last[key] = now
        return True


class RefusalLoggingAuthenticator(ThreadAuthenticator):
    """ZAP handler (own thread) that warns, per peer address at most once a minute, about refused keys.

    ``refused`` counts every refusal; read it from any thread.
    """

    def __init__(self, context: zmq.Context, warn_every: float = WARN_EVERY_S) -> None:
        super().__init__(context)
        self.refused = 0
        self._lock = threading.Lock()
        self._request: tuple[str, str] = ("", "")
        self._should_warn = _RateLimit(warn_every)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # frames: version, request id, domain, address, identity, mechanism, credentials...
        address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        key = z85.encode(msg[6]).decode() if len(msg) > 6 and len(msg[6]) == 32 else "?"
        self._request = (address, key)
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        super()._send_zap_reply(request_id, status_code, status_text, user_id)
        if status_code == b"200":
            return
        address, key = self._request
        with self._lock:
            self.refused += 1
            total = self.refused
        if self._should_warn(address):
            log.warning("refused a trainer at %s: its CurveZMQ public key %s is not in --curve-authorized-keys (%s); "
                        "%d refusals in all. Copy that trainer's NAME.key into the folder to allow it",
                        address, key, status_text.decode(errors="replace"), total)


def classify_handshake_failure(kind: int, value: int, curve: bool) -> tuple[str, str]:
    """``(category, explanation)`` of a failed handshake seen by a producer (the rate limit is per category).

    A mechanism mismatch and a decryption failure name their cause; a hang-up does not: a trainer
    without keys, or with the wrong server key, may close before we read its greeting (a race).
    """
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "mismatch", ("a trainer without CurveZMQ keys tried to connect (this producer requires them)" if curve
                            else "a trainer using CurveZMQ tried to connect (this producer has no keys)")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "crypto", ("a trainer's CurveZMQ handshake failed to decrypt: it holds the wrong server key "
                          "(its --curve-server-key must be this producer's public key)")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "hangup", "a trainer hung up during the handshake" + (
            " (most likely it has no CurveZMQ keys, or the wrong server key)" if curve else "")
    return f"other-{kind}", f"a peer's handshake failed ({_FAILED.get(kind, kind)}, code {value:#x})"


class HandshakeFailureLog:
    """Reads a bound socket's monitor for failed handshakes; ``drain()`` from one thread only."""

    def __init__(self, sock: zmq.Socket, endpoint: str, curve: bool, warn_every: float = WARN_EVERY_S) -> None:
        self.sock, self.endpoint, self.curve = sock, endpoint, curve
        self.monitor: Any = sock.get_monitor_socket(sum(_FAILED))
        self.failed = 0
        self._should_warn = _RateLimit(warn_every)

    def drain(self) -> None:
        """Count and (rate-limited) log every failed handshake reported since the last call."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind, value = event["event"], event["value"]
            self.failed += 1
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the authenticator already named the peer
            category, why = classify_handshake_failure(kind, value, self.curve)
            if not self._should_warn(category):  # per cause: an ambiguous warning never hides a clear one
                continue
            log.warning("%s on %s; %d failed handshakes in all (libzmq does not report the peer's address for "
                        "these)", why, self.endpoint, self.failed)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
