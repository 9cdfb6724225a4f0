"""What a waiting input tells its user: what it waits for, which producers it cannot reach, why it timed out,
and when waiting can no longer help (every producer refused the handshake, or sends batches that never match).

``InputDiagnosis`` reads the receive core's counters (``ReceiveStats``), the producer pool and the receiver's
connection health; it decides nothing about sockets and never blocks. Its texts name the addresses and say what to
check or which flag to change.
"""

from __future__ import annotations

from typing import Optional

from stoker.consumer.receive.errors import InputMismatchError, InputModeError
from stoker.consumer.receive.contract import Receiver
from stoker.consumer.receive.stats import ReceiveStats


class InputDiagnosis:
    """Diagnoses one input: ``receiver`` (its pool and connection health), ``stats``, ``recv_timeout`` for texts."""

    def __init__(self, receiver: Receiver, stats: ReceiveStats, recv_timeout: float) -> None:
        self.receiver, self.pool, self.stats = receiver, receiver.pool, stats
        self.sources = receiver.pool.describe()  # the addresses or names the user gave
        self.recv_timeout = recv_timeout

    def waiting_for(self) -> list[str]:
        """A line each: the pool, connections, each producer's last batch, rejected messages, and what the receiver
        knows (``waiting_report``, exact mode)."""
        stats = self.stats.snapshot()
        lines = [f"producers at {self.sources}: {len(self.pool.endpoints)} address(es), "
                 f"{stats.connected_producers} connected ({', '.join(stats.connected_endpoints) or 'none'})"]
        lines += [f"cannot receive from {endpoint}: {reason}" for endpoint, reason in self.stats.endpoint_errors()]
        lines += [f"producer {p}: {stats.per_producer.get(p, 0)} batch(es), the last {age:.1f} s ago"
                  for p, age in self.stats.last_batch_ages().items()]
        if self.stats.rejected_since_batch:
            lines.append(f"{self.stats.rejected_since_batch} message(s) rejected since the last batch: "
                         f"{stats.last_error}")
        return lines + self.receiver.waiting_report()

    def unreachable(self) -> list[str]:
        """Each address that cannot be reached now and why; an empty list when every producer is connected."""
        causes = [f"{endpoint}: {reason}" for endpoint, reason in self.stats.endpoint_errors()]
        if not self.pool.endpoints:
            causes.append(f"{self.sources} names no address yet (a name that does not resolve, or no producer "
                          "ready behind it)")
        elif not causes and not self.stats.connected_count():
            causes.append(f"no connection to {', '.join(self.pool.endpoints)} yet")
        return causes

    def mode_refused(self, refusals: int) -> Optional[InputModeError]:
        """Every producer refused the handshake ``refusals`` times in a row for a mode mismatch (exact vs plain)."""
        mismatches = self.receiver.mode_mismatches()
        # Counted per endpoint as the transport names it (libzmq may spell an address its own way).
        endpoints = self.pool.endpoints
        if endpoints and mismatches and sum(mismatches.get(e, 0) >= refusals for e in endpoints) >= len(endpoints):
            return InputModeError(f"every producer at {self.sources} refused the connection {refusals} times in a "
                                  f"row: {self.receiver.failures()[2]}")
        return None

    def certain_mismatch(self, refused: int) -> Optional[InputMismatchError]:
        """Before any batch was accepted: every producer of the pool (at least as many as its addresses, or as are
        connected) sent ``refused`` batches that can never match the spec and none that could."""
        mismatched = self.stats.misconfigured_producers(refused)
        # Every address of the pool, not only those connected yet: the first producer to connect may be the wrong one.
        if not mismatched or len(mismatched) < max(1, len(self.pool.endpoints), self.stats.connected_count()):
            return None
        # One line per distinct way of not matching (the same spec from several producers is said once).
        ways: dict[str, str] = {}
        for producer, why in mismatched.items():
            ways.setdefault(why.replace(producer, "{}"), why)
        return InputMismatchError(f"every producer at {self.sources} sent batches this trainer can never take "
                                  f"({len(mismatched)} producer(s), {refused} or more batches each, none it could "
                                  "take; a producer's batches do not change while it runs): "
                                  + " | ".join(list(ways.values())[:3])
                                  + (f" | and {len(ways) - 3} more" if len(ways) > 3 else ""))

    def timeout_message(self, silent: float, handshake_failures_before: int) -> str:
        """Why no acceptable batch arrived for ``silent`` s: rejected batches, failed handshakes (beyond the first
        ``handshake_failures_before``), unreachable addresses, or silence."""
        message = (f"no acceptable batch from any producer at {self.sources} for {silent:.0f} s "
                   f"(recv_timeout={self.recv_timeout:g})")
        causes = []
        rejected = self.stats.rejected_since_batch
        if rejected:
            causes.append(f"{rejected} message(s) arrived and were rejected, the last one because: "
                          f"{self.stats.last_error}")
        count, endpoint, reason = self.receiver.failures()
        handshakes = count - handshake_failures_before
        if handshakes:
            causes.append(f"{handshakes} connection handshake(s) failed, the last with {endpoint}: {reason}")
        talked = bool(causes)
        for endpoint, reason in self.stats.endpoint_errors():
            causes.append(f"cannot receive from {endpoint}: {reason}")
        if not self.pool.endpoints:
            causes.append(f"{self.sources} named no producer (a name that resolves to nothing: is any producer "
                          "running and ready?)")
        elif not talked:
            causes.append("nothing arrived: check the producers run (`stoker produce`) and that this host can reach "
                          "those addresses")
        return message + "; " + "; ".join(causes)
