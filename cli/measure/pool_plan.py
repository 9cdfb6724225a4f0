"""``stoker bench pool``'s arithmetic: from one core's images/s on the user's own pipeline and data to the data
hosts a stated trainer demand needs.

``workers = ceil(demand x (1 + headroom) / per_core)``: a worker is one process on one core, and workers scale
linearly on a many-core host (1.00 / 1.00 / 0.99 of linear at 1 / 4 / 14 workers on 16 cores, docs/performance.md
section 13); ``hosts = ceil(workers / workers_per_host)``, a host giving its daemon and the kernel's network work one
core (``cores - 1`` workers: the daemon took 0.35 cores at 14 workers there). The same headroom as the trainers'
estimate (``consumer/sizing``), so the plan and the running answer (``stoker_desired_producers``) agree.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from stoker.consumer.sizing.pool_sizing import DEFAULT_HEADROOM


@dataclass(frozen=True)
class PoolPlan:
    """What a demand needs, and what it was computed from."""

    per_core_images_per_s: float
    demand_images_per_s: float
    headroom: float
    cores_per_host: int
    workers_per_host: int
    workers: int
    hosts: int
    sample_bytes: int

    @property
    def supply_images_per_s(self) -> float:
        """What the planned hosts make, all workers busy."""
        return self.hosts * self.workers_per_host * self.per_core_images_per_s

    @property
    def gbit_per_s(self) -> float:
        """The demand in Gbit/s on the wire (uint8 samples as the pipeline makes them)."""
        return self.demand_images_per_s * self.sample_bytes * 8 / 1e9

    def as_dict(self) -> dict:
        return {**asdict(self), "supply_images_per_s": self.supply_images_per_s, "gbit_per_s": self.gbit_per_s}

    def table(self) -> str:
        rows = [("one core, your pipeline", f"{self.per_core_images_per_s:,.0f} images/s"),
                ("trainer demand", f"{self.demand_images_per_s:,.0f} images/s ({self.gbit_per_s:.1f} Gbit/s)"),
                (f"x {1 + self.headroom:.2f} headroom", f"{self.demand_images_per_s * (1 + self.headroom):,.0f} images/s"),
                ("decode workers", f"{self.workers}"),
                (f"hosts of {self.cores_per_host} cores", f"{self.hosts} ({self.workers_per_host} workers each, "
                 f"`stoker produce --workers {self.workers_per_host}`)"),
                ("their supply", f"{self.supply_images_per_s:,.0f} images/s")]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}} | {value}" for name, value in rows)


def plan_pool(per_core_images_per_s: float, demand_images_per_s: float, cores_per_host: int,
              headroom: float = DEFAULT_HEADROOM,
              workers_per_host: int | None = None, sample_bytes: int = 0) -> PoolPlan:
    """The plan; ValueError for a rate, demand or host size that cannot be planned for, naming it."""
    if not per_core_images_per_s > 0:
        raise ValueError(f"the measured rate must be > 0 images/s, got {per_core_images_per_s}")
    if not demand_images_per_s > 0:
        raise ValueError(f"--demand must be > 0 images/s, got {demand_images_per_s}")
    if cores_per_host < 1 or headroom < 0:
        raise ValueError(f"--cores-per-host must be >= 1 and --headroom >= 0, got {cores_per_host}, {headroom}")
    per_host = workers_per_host if workers_per_host is not None else max(1, cores_per_host - 1)
    if per_host < 1:
        raise ValueError(f"--workers-per-host must be >= 1, got {per_host}")
    workers = max(1, math.ceil(demand_images_per_s * (1 + headroom) / per_core_images_per_s - 1e-9))
    return PoolPlan(per_core_images_per_s, demand_images_per_s, headroom, cores_per_host, per_host, workers,
                    math.ceil(workers / per_host), sample_bytes)
