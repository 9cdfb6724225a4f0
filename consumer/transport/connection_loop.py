"""Many producer connections on a bounded number of threads: selector loops over non-blocking ZMTP sockets.

A ``ConnectionLoop`` owns at most ``max_threads`` threads, named ``{name}-{k}``: one more per connection
added until the bound, then each new connection goes to the thread serving fewest. Each thread is a
``selectors.DefaultSelector`` (epoll: no limit at descriptor 1024) loop over its ``LoopConnection``s
(``loop_connection``): it serves the connections the selector finds ready, those whose timer came (connects,
backoff, stalls, handshake deadlines: a heap of each connection's ``next_tick``, so a turn costs the
connections due, not all of them) and those that asked (``wake``: sends waiting, room again, leaving: a
peer that is leaving wakes its connection, which is closed on the next turn). ``close`` stops every thread
within about ``poll_s`` (each closes its connections and tells their peers, ``Peer.closed``). An
unexpected failure in a connection's peer goes to ``on_error`` and that connection starts again; the
thread keeps serving the others. ``reserve_descriptors`` raises the limit on open files to what many
connections need, or says how.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Callable

from stoker.consumer.transport.loop_connection import LoopConnection
from stoker.protocol.descriptors import raise_open_files_limit

log = logging.getLogger("stoker.consumer")

#: The most receive threads one loop runs, however many producers (issue 41: a thousand per trainer).
MAX_THREADS = 8


def reserve_descriptors(connections: int, per_connection: int = 1, spare: int = 256) -> None:
    """Raise the soft limit on open files to what ``connections`` need (up to the hard limit); an OSError that names
    ``ulimit -n`` when the hard limit is too low (``protocol/descriptors.py``)."""
    raise_open_files_limit(connections * per_connection + spare, f"{connections} producer connections",
                           "connect this trainer to fewer producers")


class ConnectionLoop:
    """See the module doc. ``on_error(endpoint, exc)``: an unexpected exception in a connection's peer."""

    def __init__(self, name: str, poll_s: float, on_error: Callable[[str, Exception], None],
                 max_threads: int = MAX_THREADS) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads={max_threads}: at least 1")
        self._name, self._poll_s, self._on_error, self._max = name, poll_s, on_error, max_threads
        self._threads: list[_LoopThread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def add(self, connection: LoopConnection) -> None:
        """Serve ``connection`` from now on (RuntimeError once closed)."""
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the connection loop is closed")
            if len(self._threads) < self._max:
                thread = _LoopThread(f"{self._name}-{len(self._threads)}", self._poll_s, self._stop, self._on_error)
                self._threads.append(thread)
                thread.start()
            else:
                thread = min(self._threads, key=lambda t: t.count)
            thread.add(connection)

    @property
    def threads(self) -> int:
        """Threads running now."""
        return sum(t.is_alive() for t in self._threads)

    def close(self, timeout: float = 1.5) -> None:
        """Stop every thread (each closes its connections), waiting up to ``timeout`` s for them all."""
        self._stop.set()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.wake()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        lingering = [t.name for t in threads if t.is_alive()]
        if lingering:
            log.warning("receive loop threads still running after the stop: %s", ", ".join(lingering))


class _LoopThread(threading.Thread):
    """One selector loop over some connections; see the module doc."""

    def __init__(self, name: str, poll_s: float, stop: threading.Event,
                 on_error: Callable[[str, Exception], None]) -> None:
        super().__init__(name=name, daemon=True)
        self._poll_s, self._stopping, self._on_error = poll_s, stop, on_error
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._incoming: list[LoopConnection] = []
        self._asked: set[LoopConnection] = set()  # connections that asked to be looked at (``wake``)
        self._connections: set[LoopConnection] = set()
        self._timers: list[tuple[float, int, LoopConnection]] = []  # (when, tie-break, connection): a heap
        self._order = itertools.count()
        self.count = 0  # connections given to this thread and not closed

    def add(self, connection: LoopConnection) -> None:
        connection.wake = lambda: self.wake(connection)
        connection.forget = self._forget
        with self._lock:
            self._incoming.append(connection)
            self.count += 1
        self.wake()

    def wake(self, connection: LoopConnection | None = None) -> None:
        if connection is not None:
            with self._lock:
                self._asked.add(connection)
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # full (a wake is pending anyway) or closed (the thread ended)

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                with self._lock:
                    incoming, self._incoming = self._incoming, []
                    asked, self._asked = self._asked, set()
                self._connections.update(incoming)
                now = time.monotonic()
                for connection in [*incoming, *asked, *self._due(now)]:
                    self._turn(connection, now)
                wait = self._timers[0][0] - time.monotonic() if self._timers else self._poll_s
                for key, mask in self._selector.select(min(self._poll_s, max(0.0, wait))):
                    if key.data is None:
                        self._drain_wake()
                    else:
                        self._serve(key.data, lambda c: c.ready(mask))
        finally:
            for connection in [*self._connections, *self._incoming]:
                self._close(connection)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _due(self, now: float) -> list[LoopConnection]:
        """The connections whose timer came by ``now`` (each once; an entry superseded by an earlier one is
        dropped)."""
        timers, out = self._timers, []
        while timers and timers[0][0] <= now:
            when, _, connection = heapq.heappop(timers)
            if connection.tick_at == when:
                connection.tick_at = float("inf")
                out.append(connection)
        return out

    def _turn(self, connection: LoopConnection, now: float) -> None:
        """A new, woken or due connection: closed if its peer is leaving (now, not at a later tick: a peer that left
        may be waited for, a pool's producer one at a time) or it closed itself, else its timers ticked."""
        if connection not in self._connections:
            return  # closed on this turn already
        if connection.peer.leaving() or connection.state == "closed":
            self._connections.discard(connection)
            self._close(connection)
            return
        self._serve(connection, lambda c: c.tick(now))

    def _schedule(self, connection: LoopConnection) -> None:
        """Put ``connection``'s next timer in the heap if it is earlier than the one there."""
        when = connection.next_tick(time.monotonic())
        if when < connection.tick_at:
            connection.tick_at = when
            heapq.heappush(self._timers, (when, next(self._order), connection))

    def _serve(self, connection: LoopConnection, step: Callable[[LoopConnection], None]) -> None:
        """One step of one connection, then what its selector registration should be; an unexpected failure
        goes to ``on_error`` and the connection starts again."""
        if connection.state == "closed":
            return
        try:
            step(connection)
        except Exception as exc:  # never die silently, never take the other connections down with it
            log.exception("receive loop: the connection to %s failed", connection.endpoint)
            self._on_error(connection.endpoint, exc)
            connection.reset()
        self._schedule(connection)
        wanted, sock = connection.wanted(), connection.sock
        if wanted == connection.events or sock is None:
            return
        if not connection.events:
            self._selector.register(sock, wanted, connection)
        elif wanted:
            self._selector.modify(sock, wanted, connection)
        else:
            self._selector.unregister(sock)
        connection.events = wanted

    def _forget(self, sock: socket.socket) -> None:
        """Unregister ``sock`` before its connection closes it (its descriptor may be reused at once)."""
        try:
            key = self._selector.get_key(sock)
        except (KeyError, ValueError):
            return
        self._selector.unregister(sock)
        key.data.events = 0

    def _close(self, connection: LoopConnection) -> None:
        if connection.state != "closed" or connection.sock is not None:
            connection.close()
        with self._lock:
            self.count -= 1
        try:
            connection.peer.closed()
        except Exception:
            log.exception("receive loop: closing the connection to %s failed", connection.endpoint)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
