"""Which producers the exact control plane must look at on a turn, so that a turn costs what changed, not the fan-in.

A trainer reading 1,024 producers turns its loop hundreds of times a second; looking at every producer each turn
(connection events, hellos due, credit and reports waiting, heartbeats) was most of its CPU. ``Attention`` keeps:

- ``due(now)``: the producers whose credit, reports or heartbeat may be due by now, from a heap of times
  (``at(i, when)``; a later time than one already set is ignored: the earlier entry, once due, is checked and set
  again at the producer's real next time, so the heap holds at most a few entries per producer);
- ``changed()``: the producers to look at for connection events: those whose link said it changed (``flag``, from
  a direct link's loop thread), those whose link must be asked every turn (libzmq's monitor: ``watch_always``),
  those waiting for a describe's answer or a hello (``wait``), or every one on the first turn after
  the trainer activated (``changed(active)``).

The control plane's thread calls everything but ``flag`` (any thread).

Liveness (docs/protocol.md "Liveness"): how often a connection with no other traffic carries a heartbeat
(``heartbeat_every``, from the producer's trainer timeout) and how often this trainer asks a producer for a status
that says nothing new (``status_every``, from the fan-in): both are the old figures (0.5 s, 1 s) for an older peer
or a small job, and fewer where a thousand connections would make liveness most of the control traffic.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable, Optional

#: A heartbeat goes on a connection with no other traffic this long (an older producer: it says no trainer timeout)
HEARTBEAT_S = 0.5
#: ... and at most this long apart whatever the producer's trainer timeout
MAX_HEARTBEAT_S = 2.0
#: A producer's status that says nothing new: every second up to this many producers, then fewer
STATUS_FAN_IN = 64
#: ... at most this long apart (and at most a quarter of the stall bound: an idle producer's status excuses it)
MAX_STATUS_S = 2.5


def heartbeat_every(trainer_timeout: Optional[float]) -> float:
    """Seconds between heartbeats on a connection with no other traffic, for a producer that takes a trainer silent
    for ``trainer_timeout`` seconds for dead (None: an older producer, which does not say): eight a timeout, never
    fewer than the old two a second for a short one, at most ``MAX_HEARTBEAT_S`` apart."""
    if trainer_timeout is None:
        return HEARTBEAT_S
    return min(MAX_HEARTBEAT_S, max(HEARTBEAT_S, trainer_timeout / 8))


def status_every(producers: int, stall_after: Optional[float]) -> float:
    """Seconds between the statuses that say nothing new a trainer reading ``producers`` asks each producer for (a
    hello's ``status_s``): one a second up to ``STATUS_FAN_IN`` producers, then growing with the fan-in, at most
    ``MAX_STATUS_S`` and a quarter of ``stall_after`` (an idle producer is not taken for stuck while its status is
    that fresh), never under a second (the old figure)."""
    cap = MAX_STATUS_S if stall_after is None else min(MAX_STATUS_S, stall_after / 4)
    return max(1.0, min(cap, producers / STATUS_FAN_IN))


class Attention:
    """See the module doc."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._at: dict[int, float] = {}  # producer -> the earliest time it is in the heap for
        self._flagged: deque[int] = deque()  # appended by loop threads (deque.append is thread-safe)
        self._always: set[int] = set()
        self._waiting: set[int] = set()
        self._everyone: list[int] = []
        self._active = False  # the trainer was active on an earlier turn

    # ---- sends: credit, reports, heartbeats ---------------------------------------------------------

    def at(self, i: int, when: float) -> None:
        """Producer ``i`` needs a look at ``when`` (or earlier, if it already has an earlier time)."""
        if when < self._at.get(i, float("inf")):
            self._at[i] = when
            heapq.heappush(self._heap, (when, i))

    def due(self, now: float) -> list[int]:
        """The producers whose time came by ``now`` (each once; ``at`` again for the next)."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            when, i = heapq.heappop(heap)
            if self._at.get(i) == when:  # else superseded by an earlier entry, already handled
                del self._at[i]
                out.append(i)
        return out

    # ---- connection events, describes, hellos -----------------------------------------------------------

    def added(self, i: int, notifies: bool) -> None:
        """A new producer ``i``: looked at on the next turn; every turn if its link does not ``flag`` its changes."""
        self._everyone.append(i)
        self._waiting.add(i)
        if not notifies:
            self._always.add(i)

    def removed(self, i: int) -> None:
        self._always.discard(i)
        self._waiting.discard(i)
        if i in self._everyone:
            self._everyone.remove(i)

    def flag(self, i: int) -> None:
        """Producer ``i``'s link changed (any thread)."""
        self._flagged.append(i)

    def wait(self, i: int, waits: bool) -> None:
        """Whether producer ``i`` waits for something time brings (a describe's answer, a hello): then it is looked
        at every turn, else again when its link changes."""
        if waits:
            self._waiting.add(i)
        else:
            self._waiting.discard(i)

    def changed(self, active: bool) -> Iterable[int]:
        """The producers to look at this turn, in number order: every one on the first turn ``active`` (the
        trainer activated: hellos are due on every connection)."""
        if active and not self._active:
            self._active = True
            self._flagged.clear()
            return list(self._everyone)
        look = set(self._always) | self._waiting
        flagged = self._flagged
        while flagged:
            look.add(flagged.popleft())
        return sorted(look)
