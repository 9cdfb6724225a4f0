"""The producers an exact-mode trainer connects to: what it knows of each, and their links.

- ``KnownProducer``: one record per producer connection, by the producer's number (``stoker_source``
  in its queued batches), which stays its own after it leaves the pool (its ``link`` is then None):
  the connection and the session this trainer runs with it, its latest status, the records of it
  queued here (``held``) and those steps consumed that it was not told yet (``reports``), the credit
  owed to it, and when it was last heard from, sent a batch and was read; and its standing in this
  trainer's elastic pool (``pool_work``): serving it (``pooled``), told to start afresh as stuck
  (``restarted``), told the pool is finished (``told_finished_in``). What the pool's scheduler knows of
  it (splits, pace, cache) is its ``PoolMember`` (``pool/pool_member.py``), under the lock.
- ``ProducerLinks``: the records in one list, the ``zmq.Poller`` over their links (a direct link's shared
  ``ReadyQueue``'s one pipe, or each libzmq socket; ready producers least recently read first), and what goes back to them besides hellos: credit, consumed records,
  heartbeats (``control_plane``'s doc says when), and a goodbye when the trainer's input closes.

The control plane's thread owns both; ``stream``, ``held`` and ``reports`` are also touched by the
steps (``ExactControlPlane.record_consumed``), so those are read and written under the control plane's lock.
The pool standing is written and read by the control plane's thread alone, so it needs no lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

import numpy as np
import zmq

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import (Credit, Goodbye, Hello, Records, decode_status, encode_credit,
                                            encode_goodbye, encode_hello)
from stoker.protocol.input_state import rows_by_epoch

from stoker.consumer.exact.attention import HEARTBEAT_S, Attention, status_every
from stoker.consumer.exact.control_counts import ControlCounts  # its users import it from here too
from stoker.consumer.exact.known_producer import KnownProducer  # its users import it from here too
from stoker.consumer.exact.links import Link
from stoker.consumer.transport.ready_queue import ReadyQueue

__all__ = ["KnownProducer", "ProducerLinks", "ControlCounts", "merge_reports", "HEARTBEAT_S", "REPORT_WAIT_S"]

#: How long consumed records may wait for a credit to carry them before they go alone: a message per step
#: would double the control traffic (and the wake-ups on both sides) for nothing.
REPORT_WAIT_S = 0.1


def merge_reports(reports: list[tuple[np.ndarray, np.ndarray]]) -> Records:
    """Consumed records as a message carries them: ``[(epoch, [indices])]``, one entry per epoch."""
    if not reports:
        return []
    epochs = np.concatenate([e for e, _ in reports])
    indices = np.concatenate([ix for _, ix in reports])
    return [(e, indices[rows].tolist()) for e, rows in rows_by_epoch(epochs)]


class ProducerLinks:
    """The producers' connections by number (``producers``), and what this trainer sends back on them besides
    hellos: credit for queued batches, in steps of half the ``credit`` window; consumed records; heartbeats.
    ``connect(address)`` makes a link (ValueError for a bad address); ``lock``: the control plane's, which guards the
    records' ``reports``; ``stall_after``: the control plane's, which bounds how far apart a hello asks for statuses.
    ``control``: control messages sent and received, and their bytes."""

    def __init__(self, connect: Callable[[str], Link], credit: int, lock: threading.Lock,
                 stall_after: Optional[float] = None) -> None:
        self._connect, self.credit, self._lock, self._stall_after = connect, credit, lock, stall_after
        self.producers: list[KnownProducer] = []
        self._poller = zmq.Poller()  # the live sockets (made once: zmq.select would build one per call)
        self._number: dict[object, int] = {}  # a libzmq link's socket -> its number
        self._direct: dict[Link, int] = {}  # a link queued in a ReadyQueue while it holds a message -> its number
        self._queues: dict[ReadyQueue, int] = {}  # the ready queues polled (their pipes) -> links in each
        self.control = ControlCounts()
        #: who needs a look on a turn (sends due, connection events): a turn's cost does not grow with the fan-in
        self.attention = Attention()
        self._reported: deque[int] = deque()  # producers whose first unsent report was made (any thread)

    def add(self, address: str) -> int:
        """Connect to one more producer; its number. ValueError for a bad address."""
        link = self._connect(address)
        with self._lock:
            self.producers.append(KnownProducer(address, link, time.monotonic()))
            i = len(self.producers) - 1
        queue: Optional[ReadyQueue] = getattr(link, "ready_queue", None)
        if queue is None:
            self._poller.register(link.pollable, zmq.POLLIN)
            self._number[link.pollable] = i
        else:  # one pipe for every link sharing the queue: polled once, however many links
            if queue not in self._queues:
                self._poller.register(queue.pollable, zmq.POLLIN)
                self._queues[queue] = 0
            self._queues[queue] += 1
            self._direct[link] = i
        notifies = hasattr(link, "on_change")  # a direct link says when its connection changed; libzmq's is asked
        if notifies:
            link.on_change = lambda: self.attention.flag(i)  # type: ignore[attr-defined]
        self.attention.added(i, notifies)
        return i

    def remove(self, address: str) -> Optional[int]:
        """Disconnect from the producer at ``address``; its number (None if not connected)."""
        for i, p in enumerate(self.producers):
            link = p.link
            if p.address == address and link is not None:
                self._forget(link)
                link.close(linger_ms=0)
                link.join(1.0)
                p.link, p.status = None, None
                self.attention.removed(i)
                return i
        return None

    def _forget(self, link: Link) -> None:
        """Poll ``link`` no more (it is closed next)."""
        queue: Optional[ReadyQueue] = getattr(link, "ready_queue", None)
        if queue is None:
            self._poller.unregister(link.pollable)
            del self._number[link.pollable]
            return
        del self._direct[link]
        self._queues[queue] -= 1
        if not self._queues[queue]:
            self._poller.unregister(queue.pollable)
            del self._queues[queue]

    def live(self) -> list[int]:
        """The numbers of the producers connected now (in the pool)."""
        return [i for i, p in enumerate(self.producers) if p.link is not None]

    def poll(self, timeout_ms: int, most: Optional[int] = None) -> list[int]:
        """The producers with a message waiting, after at most ``timeout_ms``, the one read longest ago first: a
        receiver with room for one batch per turn (a slow step) reads each producer in turn, never the first
        registered alone (which starved the others and made them look stuck). ``most``: of the links sharing a
        ready queue, at most this many (those left wait their turn), so a call costs what it returns, not the
        fan-in; libzmq links are each polled (all of them ready, whatever ``most``)."""
        if not self._number and not self._direct:
            time.sleep(timeout_ms / 1000)
            return []
        ready = self._take(most)
        if ready and not self._number:
            return ready  # nothing else to poll: no wait, no system call
        events = self._poller.poll(0 if ready else timeout_ms)
        if not ready and self._queues:
            ready = self._take(most)
        polled = [self._number[sock] for sock, _ in events if sock in self._number]
        if len(polled) > 1:
            polled.sort(key=self._read_turn)
        return ready + polled

    def _take(self, most: Optional[int]) -> list[int]:
        """Up to ``most`` direct links holding a message, from their ready queues (in turn: read longest ago first)."""
        out: list[int] = []
        for queue in self._queues:
            for link in queue.take(most if most is None else most - len(out)):
                i = self._direct.get(link)  # type: ignore[call-overload]
                if i is not None:  # else a link removed, closing: its close takes it out of the queue
                    out.append(i)
        return out

    def _read_turn(self, i: int) -> int:
        return self.producers[i].read_turn

    def owned(self, i: int) -> bool:
        """Whether producer ``i``'s batches arrive in memory the sink may own (``links``)."""
        link = self.producers[i].link
        return link is not None and link.owned

    def send(self, i: int, frame: bytes) -> bool:
        """Whether ``frame`` went out to producer ``i`` (False: not connected, and the next connection says hello)."""
        p = self.producers[i]
        if p.link is None or not p.link.send(frame):
            return False  # it left the pool, or is not connected
        p.last_sent = time.monotonic()
        self.control.count_sent(len(frame))
        self.attention.at(i, p.last_sent + p.heartbeat_s)
        return True

    def hello(self, i: int, hello: Hello) -> bool:
        """Send ``hello`` to producer ``i``, asking for statuses that say nothing new as often as this fan-in wants
        (``attention.status_every``); whether it went out (``send``)."""
        hello.status_s = status_every(len(self.producers), self._stall_after)
        return self.send(i, encode_hello(hello))

    def give_back(self, i: int) -> None:
        """One credit back to producer ``i`` (a batch of it was queued or dropped). Credit goes in steps of half
        the window: a message per batch would be most of the control traffic and of both sides' wake-ups; what
        is held back goes with the next ``send_due`` after ``REPORT_WAIT_S`` at the latest."""
        p = self.producers[i]
        if not p.owed:
            p.owed_at = time.monotonic()
            self.attention.at(i, p.owed_at + REPORT_WAIT_S)
        p.owed += 1
        if p.owed >= max(1, self.credit // 2):
            self._send_credit(i)

    def send_due(self, now: float, force: bool = False) -> None:
        """Send consumed records and credit that waited ``REPORT_WAIT_S`` (``force``: all of them, e.g. when the
        input stops), and heartbeats where nothing went out for ``HEARTBEAT_S``: only to the producers whose time
        came (``attention``), unless ``force``: heartbeats as often as the producer's trainer timeout asks
        (``KnownProducer.heartbeat_s``)."""
        while self._reported:
            i = self._reported.popleft()
            self.attention.at(i, self.producers[i].reported_at + REPORT_WAIT_S)
        for i in self.live() if force else self.attention.due(now):
            p = self.producers[i]
            if p.session == 0 or p.link is None:
                continue  # no hello yet (the hello's send sets its time), or gone
            # Reports and credit wait for each other up to REPORT_WAIT_S (unless forced); a heartbeat goes anyway.
            with self._lock:
                reports_due = bool(p.reports) and (force or now - p.reported_at >= REPORT_WAIT_S)
            credit_due = p.owed > 0 and (force or now - p.owed_at >= REPORT_WAIT_S)
            if reports_due or credit_due or now - p.last_sent >= p.heartbeat_s:
                self._send_credit(i)
            with self._lock:
                report_at = p.reported_at + REPORT_WAIT_S if p.reports else float("inf")
            when = min(p.last_sent + p.heartbeat_s, p.owed_at + REPORT_WAIT_S if p.owed else report_at, report_at)
            self.attention.at(i, max(when, now + REPORT_WAIT_S / 10))  # a send that failed: tried again soon

    def consumed(self, i: int, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step consumed these records of producer ``i`` (any thread, under the lock): reported with the next
        message to it; the first since the last message sets its time to send (``send_due``)."""
        p = self.producers[i]
        if not p.reports:
            self._reported.append(i)
        p.consumed(epochs, indices)

    def changed(self, active: bool) -> list[int]:
        """The connected producers to look at this turn for connection events, describes and hellos
        (``attention``); every one on the first turn ``active`` (the ledger activated: hellos are due)."""
        return [i for i in self.attention.changed(active) if self.producers[i].link is not None]

    def _send_credit(self, i: int) -> None:
        """Send the credit owed to producer ``i`` and the records consumed since the last message (either may be
        none: then it is a heartbeat)."""
        p = self.producers[i]
        with self._lock:
            reports, p.reports = p.reports, []
        n, p.owed = p.owed, 0
        frame = encode_credit(Credit(p.session, n, merge_reports(reports)))
        if self.send(i, frame):
            if not n and not reports:
                self.control.heartbeat_bytes += len(frame)
        else:
            # Kept for the next message (a connection that stays up with a full send pipe); a new connection's
            # hello resets both (it carries the stream's progress and the whole credit).
            p.owed += n
            with self._lock:
                p.reports = reports + p.reports

    def skipped(self) -> int:
        """Records the producers said they skipped for bad data (their last statuses' ``skipped``, summed)."""
        return sum(p.status.skipped for p in self.producers if p.status is not None)

    def finished(self) -> bool:
        """Every producer connected said it finished its epochs."""
        live = False  # stops at the first producer not finished: asked every turn, of 1,024 producers
        for p in self.producers:
            if p.link is not None:
                if p.status is None or not p.status.finished:
                    return False
                live = True
        return live

    def spec(self) -> Optional[list[tuple[str, str, list[int]]]]:
        """The batch spec a producer described (the first that did), or None yet."""
        for p in self.producers:
            if p.status is not None and p.status.spec:
                return p.status.spec
        return None

    def live_links(self) -> list[Link]:
        return [p.link for p in self.producers if p.link is not None]

    def connected(self) -> set[str]:
        return set().union(*(link.connected for link in self.live_links()))

    def say_goodbye(self, deadline: float) -> int:
        """Tell each producer this trainer has a session with that it leaves, after what the steps consumed (sent
        now): it serves what this trainer held to the others at once. Only to a producer whose status says it
        takes a goodbye (an older one counts an unknown message as bad), and never with records unreported (it
        would serve them again). Then wait, until ``deadline`` at most, for each to answer (a status of session 0:
        it no longer knows this trainer), reading and dropping what else comes: a connection closed with data
        unread is reset, and a producer writing to it then may lose the goodbye unread. Best effort (a producer
        that does not answer takes this trainer for gone, as before); how many answered."""
        self.send_due(time.monotonic(), force=True)
        waiting = set()
        for i in self.live():
            p = self.producers[i]
            with self._lock:
                unreported = bool(p.reports)
            if p.session and p.status is not None and p.status.goodbye and not unreported \
                    and self.send(i, encode_goodbye(Goodbye(p.session))):
                waiting.add(i)
        said = len(waiting)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for i in self.poll(max(1, int(left * 1000))):
                if self._farewell(i):
                    waiting.discard(i)
        return said - len(waiting)

    def _farewell(self, i: int) -> bool:
        """Read one message of producer ``i`` (a leaving trainer drops batches): whether it answers a goodbye."""
        link = self.producers[i].link
        assert link is not None
        try:
            message = link.receive()
            return isinstance(message, tuple) and decode_status(message[0]).session == 0
        except ProtocolError:
            return False

    def close(self, linger_s: float, goodbye: bool = False) -> None:
        """Close every link (``goodbye``: ``say_goodbye`` first); what they queued, goodbyes and their answers
        included, gets up to ``linger_s``, all links together."""
        # A libzmq close returns at once (the context's term waits), a direct link's waits for its own queue, so
        # each gets what is left of one deadline.
        deadline = time.monotonic() + linger_s
        if goodbye:
            self.say_goodbye(deadline)
        links = self.live_links()
        for link in links:
            link.close(linger_ms=max(0, int((deadline - time.monotonic()) * 1000)))
        deadline = time.monotonic() + 1.0
        for link in links:
            link.join(max(0.0, deadline - time.monotonic()))

    def failures(self) -> tuple[int, str, str]:
        """``(count, endpoint, reason)`` of failed handshakes over the producers in the pool."""
        links = self.live_links()
        if not links:
            return 0, "", ""
        each = [link.health.summary() for link in links]  # copies: a direct link's thread writes its counts
        _, endpoint, reason = max(each, key=lambda summary: summary[0])
        return sum(count for count, _, _ in each), endpoint, reason
