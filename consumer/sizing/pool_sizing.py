"""How many producers this trainer needs, with the formula's inputs: ``PoolSizing`` and its one writer.

``needed = (demand x (1 + headroom) - what producers on the trainer's host make) / capacity per remote producer``
(``demand.py``, ``supply.py``; the pool adds remote producers, so it counts those), fractional, exported as
is so that several trainers sharing a pool add up their needs and the job rounds once (16 trainers needing 0.3
each ask for ceil(4.8) = 5 producers, not 16): Prometheus sums ``stoker_trainer_producers_needed`` and the HPA's
``AverageValue`` target of 1 takes the ceiling; ``stoker cluster --autoscale`` does the same sum and rounds with the
same ``SizingPolicy``. ``desired`` is this trainer's own rounded answer (``policy.py``), right for a one-trainer job.

``PoolSizer`` is owned by the receive core: its sampler thread feeds the demand meter and calls ``update`` about
once a second; the receive path feeds the supply meter per batch; readers take ``latest`` (a frozen snapshot).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from stoker.consumer.sizing.demand import Demand, DemandMeter
from stoker.consumer.sizing.policy import SizingPolicy
from stoker.consumer.sizing.supply import Supply, SupplyMeter

#: Supply kept above demand: a producer slowed by a neighbour, a shard fetched cold, a worker restarting.
DEFAULT_HEADROOM = 0.15


@dataclass(frozen=True)
class PoolSizing:
    """One reading of the estimate; fields None where not known yet (no consumption, or no timed batch).

    ``producers_needed``: fractional, headroom included; ``desired_producers``: rounded with hysteresis;
    ``pool_producers``: producers in the pool now. ``why``: one sentence a person can check the number by."""

    demand: Optional[Demand]
    supply: Optional[Supply]
    headroom: float
    producers_needed: Optional[float]
    desired_producers: Optional[int]
    pool_producers: int
    why: str

    def as_dict(self) -> dict:
        """Flat JSON-ready form (status files, summaries, the report)."""
        d, s = self.demand, self.supply
        return {"demand_images_per_s": d.images_per_s if d else None,
                "consumed_images_per_s": d.consumed_images_per_s if d else None,
                "input_wait_fraction": d.wait_fraction if d else None, "input_bound": d.input_bound if d else None,
                "wait_timed": d.wait_timed if d else None,
                "capacity_per_producer_images_per_s": s.per_producer_images_per_s if s else None,
                "producers_timed": s.producers if s else 0,
                "local_capacity_images_per_s": s.local_images_per_s if s else None, "headroom": self.headroom,
                "producers_needed": self.producers_needed, "desired_producers": self.desired_producers,
                "pool_producers": self.pool_producers, "why": self.why}


class PoolSizer:
    """The demand and supply meters and the policy of one input; see the module doc."""

    def __init__(self, batch_size: int, headroom: float = DEFAULT_HEADROOM,
                 clock: Callable[[], float] = time.monotonic, policy: Optional[SizingPolicy] = None) -> None:
        if headroom < 0:
            raise ValueError(f"headroom must be >= 0, got {headroom}")
        self.headroom = headroom
        self.demand = DemandMeter(batch_size, clock=clock)
        self.supply = SupplyMeter(clock=clock)
        self.policy = policy or SizingPolicy(clock=clock)
        self._lock = threading.Lock()
        self._latest = PoolSizing(None, None, headroom, None, None, 0, "no reading yet: training has not started")

    @property
    def latest(self) -> PoolSizing:
        with self._lock:
            return self._latest

    def update(self, pool_producers: int) -> PoolSizing:
        """Read both meters, decide, and keep the result as ``latest``."""
        demand, supply = self.demand.estimate(), self.supply.estimate()
        needed = None
        if demand is not None and supply is not None and supply.per_producer_images_per_s > 0:
            wanted = demand.images_per_s * (1 + self.headroom)
            needed = max(0.0, wanted - supply.local_images_per_s) / supply.per_producer_images_per_s
        desired = self.policy.decide(needed)
        sizing = PoolSizing(demand, supply, self.headroom, needed, desired, pool_producers,
                            explain(demand, supply, self.headroom, needed, desired, pool_producers))
        with self._lock:
            self._latest = sizing
        return sizing


def explain(demand: Optional[Demand], supply: Optional[Supply], headroom: float, needed: Optional[float],
            desired: Optional[int], pool: int) -> str:
    """The sentence a person checks the number by."""
    if demand is None:
        return "no reading yet: nothing consumed in the last window (not started, or paused)"
    if supply is None:
        return ("demand known, producer capacity not: no batch with timed work in the last window (pre-made "
                "batches, or producers too old to time their stages)")
    state = (f"input-bound, waiting {demand.wait_fraction:.0%} of the time" if demand.input_bound
             else f"not input-bound (waiting {demand.wait_fraction:.0%})")
    local = (f"; the {supply.local_producers} on this host make {supply.local_images_per_s:,.0f}"
             if supply.local_producers else "")
    return (f"the step takes {demand.images_per_s:,.0f} images/s when not waiting ({state}); a producer makes "
            f"{supply.per_producer_images_per_s:,.0f} images/s (mean of {supply.producers}){local}; x "
            f"{1 + headroom:.2f} headroom: {needed:.2f} producers -> {desired}, the pool has {pool}")
