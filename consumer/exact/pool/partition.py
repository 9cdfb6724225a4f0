"""A partitioned topology: which ``k`` of an elastic pool's ``N`` producers each trainer of a job reads.

Every trainer of a job (rank ``r`` of ``world`` ``W``) hands out only its own share's splits, to whichever producers it
is connected to (split_scheduler.py), and a pool producer serves any trainer's splits. So a trainer need not read
every producer: one that reads ``k`` of them still has each of its splits served once per epoch, by one of those
``k``; the job's connections are ``k x W`` instead of ``N x W``. ``partition`` picks the ``k``:

    trainer r reads addresses[(r*k + j) % N] for j in 0 .. k-1

consecutive blocks of the one list every trainer is given, wrapping round, so each producer is read by
``floor(k*W/N)`` or ``ceil(k*W/N)`` trainers and none by none (``k*W >= N``). Every trainer must be given the same
list in the same order (interleave hosts in it to spread a trainer's producers over hosts). Pure; no sockets.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def partition(addresses: Sequence[str], rank: int, world: int, per_trainer: int) -> list[str]:
    """The ``per_trainer`` addresses trainer ``rank`` of ``world`` reads (see the module doc), in list order.

    ValueError, naming the fix, for a rank outside ``0 .. world-1``, ``per_trainer`` below 1 or above the
    number of addresses, an address given twice (the trainers' lists would not line up), or a partition that
    leaves a producer unread (``per_trainer * world < len(addresses)``: its split work would wait for nobody).
    """
    n = len(addresses)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}: need world >= 1 and 0 <= rank < world")
    if n == 0:
        raise ValueError("no producer addresses to partition: give the pool's addresses, the same list to every "
                         "trainer")
    if len(set(addresses)) != n:
        twice = sorted(a for a, times in Counter(addresses).items() if times > 1)[:3]
        raise ValueError(f"producer address(es) given twice: {', '.join(twice)}; give each producer once")
    if not 1 <= per_trainer <= n:
        raise ValueError(f"producers_per_trainer={per_trainer}: give 1 to {n} (the number of producer addresses)")
    if per_trainer * world < n:
        least = -(-n // world)
        raise ValueError(f"producers_per_trainer={per_trainer} with {world} trainers reads {per_trainer * world} of "
                         f"{n} producers, leaving {n - per_trainer * world} unread: give at least {least}")
    return [addresses[(rank * per_trainer + j) % n] for j in range(per_trainer)]


def readers(producers: int, world: int, per_trainer: int) -> list[int]:
    """How many trainers read each producer under ``partition`` (for checks and reports); same ValueErrors."""
    names = [str(i) for i in range(producers)]
    counts = [0] * producers
    for rank in range(world):
        for name in partition(names, rank, world, per_trainer):
            counts[int(name)] += 1
    return counts
