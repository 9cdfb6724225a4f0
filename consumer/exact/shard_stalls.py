"""Fixed-shard producers that send nothing while the trainer waits: named at a growing interval, failed past a limit.

A fixed shard is one producer's: nobody else can serve its records (an elastic pool re-serves a
stuck producer's splits instead: ``split_scheduler``). So a producer that sent no batch for
``stall_after`` while this trainer waited for data (its queue had room, or other producers moved on
meanwhile: a full queue means credit, not the producer, holds it back) is named in a warning, again
at a growing interval (bound, 2x, 4x...; ``warnings`` counts them), and past ``stall_limit``
``check`` returns the error the input fails with, naming the producer and the fix. A producer is not
waited on while it has no session, serves a pool, finished, waits for more trainers, is idle (its
open epochs wait for steps) or is not connected. Policy over the control plane's ``KnownProducer``
records, one ``_Silence`` per producer; the control plane calls ``check`` every quarter second.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

from stoker.protocol.exact_messages import Status
from stoker.protocol.input_state import InputState, StreamKey

from stoker.consumer.exact.producers import KnownProducer

log = logging.getLogger("stoker.consumer")



class _Silence:
    """One producer's warnings: when the next is due (0: not silent now) and the interval, which a producer that
    stalls again and again keeps, so it is not named at every stall."""

    __slots__ = ("next_at", "interval")

    def __init__(self) -> None:
        self.next_at = 0.0
        self.interval = 0.0


class ShardStallWatch:
    """See the module doc. ``stall_after``: seconds without a batch before a producer is named (None: never);
    ``stall_limit``: seconds before the input fails (None: it waits)."""

    def __init__(self, stall_after: Optional[float], stall_limit: Optional[float]) -> None:
        self.stall_after, self.stall_limit = stall_after, stall_limit
        self.warnings = 0  # warnings that a fixed-shard producer sends nothing
        self.queue_full_at = float("-inf")  # the trainer's queue was last full
        self._silences: dict[int, _Silence] = {}

    def queue_full(self, now: float) -> None:
        """The trainer's queue is full: producers wait for credit, which is not a stall of theirs."""
        self.queue_full_at = now

    def check(self, now: float, producers: Sequence[KnownProducer], live: Sequence[int],
              open_epochs: Callable[[str], str]) -> Optional[str]:
        """Warn about the ``live`` producers (numbers into ``producers``) silent past the bound; the error to fail
        the input with once one stayed silent past ``stall_limit`` (else None); those serving an elastic pool
        (``KnownProducer.pooled``) are not watched here. ``open_epochs(stream)``: what the trainer still waits
        for of a shard."""
        if self.stall_after is None:
            return None
        # The two latest batches: "others moved on" for producer i is the latest that is not its own.
        latest = sorted(((producers[j].batch_at, j) for j in live), reverse=True)[:2]
        for i in live:
            p = producers[i]
            silence = self._silences.get(i)
            if silence is None:
                silence = self._silences[i] = _Silence()
            if p.pooled or not _waited_on(p, now, self.stall_after):
                p.not_waited_on(now)  # its silence counts from when it is waited on again
                silence.next_at = 0.0
                continue
            others = next((t for t, j in latest if j != i), float("-inf"))
            excuse = self.queue_full_at if others - p.batch_at <= self.stall_after else float("-inf")
            silent = now - max(p.batch_at, excuse)
            if silent <= self.stall_after:
                silence.next_at = 0.0
                continue
            stream = p.status.stream if p.status is not None else ""
            if now >= silence.next_at:
                self._warn(p, stream, silent, now, open_epochs)
                silence.interval = max(self.stall_after, 2 * silence.interval)
                silence.next_at = now + silence.interval
            if self.stall_limit is not None and silent > self.stall_limit:
                return (f"producer {p.name()} sent no batch for {silent:.0f} s (stall_limit={self.stall_limit:g}) "
                        f"while this trainer waited; its fixed shard {stream} cannot be served by another "
                        f"producer ({open_epochs(stream)}). Restart that producer and this trainer from "
                        "its last checkpoint, or run the job as an elastic pool (producers --shard auto), where "
                        "other producers take a stuck one's work")
        return None

    def _warn(self, p: KnownProducer, stream: str, silent: float, now: float,
              open_epochs: Callable[[str], str]) -> None:
        self.warnings += 1
        heard = now - p.heard_at
        if p.status is not None and p.status.storage:  # its own status says why: storage, not the producer
            log.warning("producer %s is waiting on object storage (%s): no batch for %.0f s while this trainer "
                        "waited for data; its fixed shard (%s) waits for the storage to answer. %s", p.name(),
                        p.status.storage, silent, stream,
                        f"This trainer fails in {max(0.0, self.stall_limit - silent):.0f} s (stall_limit)"
                        if self.stall_limit is not None else "stall_limit is off: this trainer waits")
            return
        log.warning("producer %s sent no batch for %.0f s while this trainer waited for data (%s); a fixed "
                    "shard (%s, %s) cannot be served by another producer, so its records wait for it. "
                    "Restart it (it resumes the open epochs), or run the job as an elastic pool (producers "
                    "--shard auto). %s", p.name(), silent,
                    f"its last message came {heard:.0f} s ago" if heard > 1 else
                    "it is alive, but neither its workers nor its epochs move on", stream,
                    open_epochs(stream),
                    f"This trainer fails in {max(0.0, self.stall_limit - silent):.0f} s (stall_limit)"
                    if self.stall_limit is not None else "stall_limit is off: this trainer waits")


def _waited_on(p: KnownProducer, now: float, stall_after: float) -> bool:
    """Whether the trainer waits on ``p``'s fixed shard now (see the module doc)."""
    status, link = p.status, p.link
    if p.session == 0 or status is None or link is None or not link.connected:
        return False
    # Idle (its epochs wait for trainers to consume them), said lately and since its last batch: not stuck.
    idle = status.idle and now - p.heard_at <= stall_after
    return not (StreamKey.names_pool(status.stream) or status.finished or status.waiting > 0 or idle)


def shard_waiting(status: Optional[Status], open_epochs: Callable[[str], str]) -> str:
    """What a trainer waits for from a fixed-shard producer that sent ``status``, for its report ("" if unknown)."""
    if status is None or not status.stream:
        return ""
    what = f", serves {status.stream}: {open_epochs(status.stream)}"
    return what + (f", waits for {status.waiting} more trainer(s)" if status.waiting else "")


def open_epochs(state: InputState, stream: str) -> str:
    """What a trainer of ``state`` still waits for from fixed shard ``stream``: records of its open epoch not
    consumed (the caller holds the state's lock)."""
    progress = state.streams.get(stream)
    try:
        count = StreamKey.parse(stream).size
    except ValueError:
        return "epochs unknown"
    if progress is None:
        return f"all {count} records of its first epoch to come"
    epoch = progress.completed
    left = count - progress.consumed_in(epoch)  # not consumed(): that would open the epoch in the state
    return f"{left} of {count} records of epoch {epoch} not consumed yet"
