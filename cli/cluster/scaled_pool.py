"""The data hosts of an elastic pool, grown and shrunk to a target: ``stoker cluster --autoscale``'s hands.

Up is prompt: a producer starts on each free host (the lowest-numbered first) and the pool's addresses (the name
trainers resolve, ``elastic.PoolNames``, or a discovery list) include it at once. Down drains, newest first (LIFO:
the host that joined last leaves first, so a short burst's extra hosts are the ones given back): the host leaves
the addresses first, so the trainers' discovery drops it and its unfinished splits go back to the others
(``consumer/exact/pool``: ``PoolSeat.leave``); its producer is stopped (SIGTERM) ``drain_s`` later. A draining
host is not reused until its producer stopped. Nothing here waits: ``tick`` does what is due, from the caller's
loop.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from stoker.producer.process import ProducerProcess

#: Seconds between a host leaving the pool's addresses and its producer's stop: a few discovery rounds (1 s each
#: in ``stoker cluster``), so the trainers let it go before its sockets close.
DEFAULT_DRAIN_S = 3.0


class ScaledPool:
    """``hosts`` addresses, of which those in the pool run a producer (``start(i)`` starts one on host i)."""

    def __init__(self, hosts: Sequence[str], start: Callable[[int], ProducerProcess],
                 publish: Callable[[list[str]], None], drain_s: float = DEFAULT_DRAIN_S,
                 clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] = print) -> None:
        self.hosts = list(hosts)
        self._start, self._publish, self.drain_s, self._clock, self._log = start, publish, drain_s, clock, log
        self.in_pool: list[int] = []  # host indices, in the order they joined
        self.producers: list[ProducerProcess] = []  # every producer started, stopped ones included (the report)
        self._serving: dict[int, ProducerProcess] = {}
        self._draining: dict[int, tuple[float, ProducerProcess]] = {}  # host -> (stop at, producer)

    @property
    def size(self) -> int:
        return len(self.in_pool)

    def addresses(self) -> list[str]:
        """The pool's addresses now, in joining order."""
        return [self.hosts[i] for i in self.in_pool]

    def resize(self, target: int) -> int:
        """Grow (at once) or shrink (newest first, draining) towards ``target``; the size now. Growth stops at the
        hosts free now (a draining one frees on a later ``tick``)."""
        changed = False
        while self.size < target:
            free = next((i for i in range(len(self.hosts)) if i not in self._serving and i not in self._draining),
                        None)
            if free is None:
                break
            producer = self._start(free)
            self.producers.append(producer)
            self._serving[free] = producer
            self.in_pool.append(free)
            changed = True
        while self.size > max(0, target):
            gone = self.in_pool.pop()
            self._draining[gone] = (self._clock() + self.drain_s, self._serving.pop(gone))
            self._log(f"cluster: host {self.hosts[gone]} leaves the pool; its producer stops in {self.drain_s:.0f} s")
            changed = True
        if changed:
            self._publish(self.addresses())
        return self.size

    def tick(self) -> None:
        """Stop the drained producers whose time came."""
        now = self._clock()
        for i, (due, producer) in list(self._draining.items()):
            if now >= due:
                producer.stop()
                del self._draining[i]

    def close(self) -> None:
        """Stop every producer still running (serving or draining). Idempotent."""
        for producer in [*self._serving.values(), *(p for _, p in self._draining.values())]:
            producer.stop()
        self._serving.clear()
        self._draining.clear()
        self.in_pool.clear()

    def draining(self) -> int:
        return len(self._draining)

