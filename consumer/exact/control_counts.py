"""What exact mode's control plane sent and received: ``ControlCounts``, the totals the input's stats show, with
liveness (heartbeats, statuses) counted apart so a benchmark or a user can tell it from the control a batch costs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ControlCounts:
    """Control messages (credit, reports, hellos, work, heartbeats; statuses) and their bytes, both ways: totals for
    the input's stats. Written by the control plane's thread alone."""

    sent: int = 0
    bytes_sent: int = 0
    received: int = 0
    bytes_received: int = 0
    #: of those bytes, liveness's: heartbeats sent (credit messages carrying no credit and no records), statuses
    #: received (each is also its producer's word that it lives)
    heartbeat_bytes: int = 0
    status_bytes: int = 0

    def count_sent(self, nbytes: int) -> None:
        self.sent += 1
        self.bytes_sent += nbytes

    def count_received(self, nbytes: int) -> None:
        self.received += 1
        self.bytes_received += nbytes

    def count_status(self, nbytes: int) -> None:
        self.count_received(nbytes)
        self.status_bytes += nbytes
