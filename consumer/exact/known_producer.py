"""What an exact-mode trainer knows of one producer: ``KnownProducer`` (``producers``' module doc says what each
field holds and which are read and written under the control plane's lock)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import numpy as np

from stoker.protocol.exact_messages import Records, Status
from stoker.protocol.input_state import rows_by_epoch

from stoker.consumer.exact.attention import heartbeat_every
from stoker.consumer.exact.links import Link


class KnownProducer:
    """See the module doc. ``link``: its connection (None once it left the pool)."""

    __slots__ = ("address", "link", "session", "said_hello", "stream", "status", "held", "reports", "reported_at",
                 "owed", "owed_at", "last_sent", "described_at", "heard_at", "batch_at", "read_turn", "pooled",
                 "restarted", "told_finished_in", "hello_stream")

    def __init__(self, address: str, link: Link, now: float) -> None:
        self.address = address
        self.link: Optional[Link] = link
        self.session = 0  # this trainer's session with it: 0 before the first hello
        self.said_hello = 0  # its link's handshakes when the last hello went out
        self.stream = ""  # the stream it serves (from its status or its batches)
        self.hello_stream = ""  # the stream the current session's hello carried the progress of ("": all of it)
        self.status: Optional[Status] = None  # its latest status
        self.held: defaultdict[int, set[int]] = defaultdict(set)  # epoch -> records of it queued, not consumed
        self.reports: list[tuple[np.ndarray, np.ndarray]] = []  # (epochs, indices) consumed, not reported yet
        self.reported_at = 0.0  # when the oldest unsent report was made
        self.owed = 0  # credit earned, not sent yet
        self.owed_at = 0.0  # when the oldest unsent credit was earned
        self.last_sent = 0.0  # any message to it
        self.described_at = float("-inf")  # a describe request went out (before activation)
        self.heard_at = now  # any message (batch or status) from it
        self.batch_at = now  # a batch of the current session, or the hello that began it
        self.read_turn = 0  # the control plane's read count when it was last read: ``poll`` serves the oldest first
        self.pooled = False  # it serves this trainer's elastic pool under the current session
        self.restarted = False  # taken for stuck in the pool and told to start afresh; not answered yet
        self.told_finished_in: Optional[int] = None  # the session it was told the pool's run is complete in

    @property
    def heartbeat_s(self) -> float:
        """Seconds between heartbeats to it while nothing else goes (``attention.heartbeat_every``)."""
        status = self.status
        return heartbeat_every(status.trainer_timeout if status is not None else None)

    def name(self) -> str:
        """The producer as a person finds it: its id (from its status) and the address we connect to."""
        return f"{self.status.producer} at {self.address}" if self.status is not None else self.address

    def waiting_line(self, now: float) -> str:
        """Its line in a report of what the trainer waits for: connection, session, last batch and message."""
        what = f"{self.name()}: {'connected' if self.link is not None and self.link.connected else 'NOT connected'}"
        unknown = not self.stream and self.status is None  # the hello waits for its status (``hello_state``)
        what += f", session {self.session}" if self.session else ", no hello yet" + (", no status" if unknown else "")
        return what + f", last batch {now - self.batch_at:.1f} s ago, last message {now - self.heard_at:.1f} s ago"

    def queued(self, epochs: np.ndarray, indices: np.ndarray) -> None:
        """These records of it entered the trainer's queue: held here until a step consumes them (under the
        control plane's lock)."""
        held = self.held
        for e, of_epoch in rows_by_epoch(epochs):
            held[e].update(indices[of_epoch].tolist())

    def consumed(self, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step consumed these records of it: no longer held; reported with the next message to it (under the
        control plane's lock)."""
        held = self.held
        for e, of_epoch in rows_by_epoch(epochs):
            held[e].difference_update(indices[of_epoch].tolist())
        if not self.reports:
            self.reported_at = time.monotonic()
        self.reports.append((epochs, indices))

    def not_waited_on(self, now: float) -> None:
        """The trainer does not wait on it now (no session, a pool's, finished, idle...: ``shard_stalls``): its
        silence counts from when it waits again."""
        self.batch_at = now

    def held_records(self) -> dict[str, Records]:
        """What a hello tells it this trainer holds of it (under the control plane's lock)."""
        if not self.stream:
            return {}
        return {self.stream: [(e, sorted(ix)) for e, ix in self.held.items() if ix]}
