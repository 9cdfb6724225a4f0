"""The trainer's side of exact mode: one DEALER per producer, credit, sessions, consumed records, status.

Owned by ZMQInput's receive thread (sockets are not thread-safe), except
``record_consumed``, which steps call (from ``get()`` and the dataset) under a
lock, and ``snapshot``, which ``save_state`` calls.

- Before ``activate()`` the transport only asks producers to ``describe``
  themselves (status and batch spec) and receives nothing: a checkpoint's state can
  still be restored. After it, every new connection (a producer started or
  restarted) gets a ``hello`` with a fresh session, this trainer's whole input
  state and the records it holds from that producer; batches sent under an older
  session are dropped (their records are served again by the new incarnation).
- Each batch queued gives one credit back; consumed records (``record_consumed``)
  go to the producer they came from with the next credit or heartbeat (every
  0.5 s, also while the queue is full, so a slow step is never taken for dead).
- ``finished`` once every producer said it finished its epochs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any, Optional, Sequence

import numpy as np
import zmq

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import (Credit, Hello, Records, Status, decode_status, encode_credit,
                                            encode_describe, encode_hello, unpack_producer_frame)
from stoker.protocol.input_state import InputState

from .connections import ConnectionWatcher

log = logging.getLogger("stoker.consumer")

HEARTBEAT_S = 0.5
DESCRIBE_RETRY_S = 1.0


class ExactTransport:
    """See the module doc. ``state``: the consumed records this trainer starts from (a restored checkpoint)."""

    def __init__(self, ctx: zmq.Context, addresses: Sequence[str], trainer_id: str, state: InputState, credit: int,
                 options: Sequence[tuple[int, Any]], curve: Any = None) -> None:
        self.addresses = list(addresses)
        self.trainer_id, self.credit = trainer_id, credit
        self.sockets: list[zmq.Socket] = []
        self.watchers: list[ConnectionWatcher] = []
        for address in self.addresses:
            sock = ctx.socket(zmq.DEALER)
            for option, value in options:
                sock.setsockopt(option, value)
            if curve is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve.public, curve.secret, \
                    curve.server_public
            self.sockets.append(sock)
            self.watchers.append(ConnectionWatcher(sock, [address], curve=curve is not None))  # connects it
        n = len(self.sockets)
        self.active = False
        self.session = [0] * n
        self._said_hello = [0] * n  # handshakes seen when the last hello went out
        self.stream: list[str] = [""] * n
        self.status: list[Optional[Status]] = [None] * n
        self.stale_batches = 0
        self._lock = threading.Lock()
        self._state = state
        self._held: list[dict[int, set[int]]] = [defaultdict(set) for _ in range(n)]  # epoch -> indices
        self._reports: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (epoch, index) consumed, unsent
        self._last_sent = [0.0] * n
        self._described_at = [-DESCRIBE_RETRY_S] * n
        #: control messages sent and received, and their bytes (the receive thread writes them)
        self.control = [0, 0, 0, 0]

    # ---- state ------------------------------------------------------------------------------

    def snapshot(self) -> InputState:
        """A copy of the records consumed so far (what a checkpoint saves)."""
        with self._lock:
            return self._state.copy()

    def restore(self, state: InputState) -> None:
        if self.active:
            raise RuntimeError("restore the input state before the first get() / as_dataset() / start(): after "
                               "that, batches chosen under the old state may already be queued")
        with self._lock:
            self._state = state

    def record_consumed(self, source: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """Rows a step was given (called from the step; any thread)."""
        if source < 0:
            return  # a terminator: no records
        rows = mask.astype(bool)
        epochs, indices = epochs[rows], indices[rows]
        with self._lock:
            stream = self.stream[source]
            if stream:
                self._state.mark(stream, epochs.tolist(), indices.tolist())
            held = self._held[source]
            for e, i in zip(epochs.tolist(), indices.tolist()):
                held[e].discard(i)
                self._reports[source].append((e, i))

    # ---- connections ------------------------------------------------------------------------

    def activate(self) -> None:
        self.active = True

    def watch(self) -> bool:
        """Handle monitor events; say hello on new connections once active. True if anything changed."""
        changed = False
        for i, watcher in enumerate(self.watchers):
            changed |= watcher.poll()
            if self.active and watcher.handshakes > self._said_hello[i]:
                self._hello(i)
                self._said_hello[i] = watcher.handshakes
            if not self.active and self.status[i] is None and watcher.connected \
                    and time.monotonic() - self._described_at[i] >= DESCRIBE_RETRY_S:
                self._send(i, encode_describe())  # asked again until answered: a request is never taken as delivered
                self._described_at[i] = time.monotonic()
        return changed

    def _hello(self, i: int) -> None:
        self.session[i] += 1
        with self._lock:
            state = self._state.copy()
            held: dict[str, Records] = {}
            if self.stream[i]:
                held[self.stream[i]] = [(e, sorted(ix)) for e, ix in self._held[i].items() if ix]
            self._reports[i] = []  # the hello's state includes them
        self._send(i, encode_hello(Hello(self.trainer_id, self.session[i], self.credit, state, held)))

    def _send(self, i: int, frame: bytes) -> None:
        try:
            self.sockets[i].send(frame, flags=zmq.NOBLOCK)
            self._last_sent[i] = time.monotonic()
            self.control[0] += 1
            self.control[1] += len(frame)
        except zmq.ZMQError:
            pass  # not connected: the next connection says hello

    def flush(self) -> None:
        """Send consumed records, and heartbeats where nothing went out for a while."""
        if not self.active:
            return
        now = time.monotonic()
        for i in range(len(self.sockets)):
            if self.session[i] == 0:
                continue  # no hello yet
            with self._lock:
                reports, self._reports[i] = self._reports[i], []
            if reports or now - self._last_sent[i] >= HEARTBEAT_S:
                self._credit(i, 0, reports)

    def _credit(self, i: int, n: int, reports: list[tuple[int, int]]) -> None:
        by_epoch: dict[int, list[int]] = defaultdict(list)
        for e, index in reports:
            by_epoch[e].append(index)
        self._send(i, encode_credit(Credit(self.session[i], n, sorted(by_epoch.items()))))

    # ---- data -------------------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> list[int]:
        ready = zmq.select(self.sockets, [], [], timeout_ms / 1000)[0]
        return [self.sockets.index(s) for s in ready]

    def receive(self, i: int) -> Optional[list[Any]]:
        """The frames of a batch from producer ``i``, or None (a status, handled here)."""
        frames = self.sockets[i].recv_multipart(copy=False)
        body = unpack_producer_frame(frames[0]) if len(frames) == 1 else None
        if body is None:
            return frames
        status = decode_status(body)  # ProtocolError propagates: counted as a rejected message
        self.control[2] += 1
        self.control[3] += memoryview(frames[0]).nbytes
        self.status[i] = status
        if status.stream:
            with self._lock:
                self.stream[i] = status.stream
        return None

    def accept(self, i: int, stream: str, session: int) -> bool:
        """Whether a batch sent under ``session`` counts (not one of an older session, or before any hello)."""
        if session != self.session[i] or self.session[i] == 0:
            self.stale_batches += 1
            return False
        if stream and stream != self.stream[i]:
            with self._lock:
                self.stream[i] = stream
        return True

    def queued(self, i: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """A batch from producer ``i`` entered the queue: its records are held here; one credit back."""
        rows = mask.astype(bool)
        with self._lock:
            held = self._held[i]
            for e, index in zip(epochs[rows].tolist(), indices[rows].tolist()):
                held[e].add(index)
            reports, self._reports[i] = self._reports[i], []
        self._credit(i, 1, reports)

    @property
    def finished(self) -> bool:
        return all(s is not None and s.finished for s in self.status)

    def spec(self) -> Optional[list[tuple[str, str, list[int]]]]:
        """The batch spec a producer described (the first that did), or None yet."""
        for status in self.status:
            if status is not None and status.spec:
                return status.spec
        return None

    def close(self) -> None:
        for watcher in self.watchers:
            watcher.close()
        for sock in self.sockets:
            sock.close(linger=0)

    def connected(self) -> set[str]:
        return set().union(*(w.connected for w in self.watchers))

    def failures(self) -> tuple[int, str, str]:
        """``(count, endpoint, reason)`` of failed handshakes over all producers."""
        count = sum(w.failures.count for w in self.watchers)
        last = max(self.watchers, key=lambda w: w.failures.count)
        return count, last.failures.endpoint, last.failures.reason
