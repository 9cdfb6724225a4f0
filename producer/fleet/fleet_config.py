"""A fleet process's settings (``FleetConfig``), checked at construction, and each endpoint's daemon settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stoker.producer.serve.producer_config import ProducerConfig, settled
from stoker.producer.serve.sharding import ShardSpec

SYNTHETIC_DATASET = "synthetic-fleet"  # what an endpoint's settings name as its dataset: it reads none


@dataclass(frozen=True)
class FleetConfig:
    """Endpoints ``first .. first + count - 1`` of a fleet of ``of``; endpoint ``i`` serves shard ``i/of`` of a
    synthetic dataset of ``records x of`` records in batches of ``batch_size`` images of ``image_size`` px.

    ``exact``: each endpoint serves its fixed shard in exact mode (``--exact``; ``epochs`` as ``--epochs``),
    through the daemon's own choice of policy (``policy_for``: ``FixedShardPolicy``) and ``ExactForwarder``.
    ``pool``: each endpoint is a producer of one elastic pool (``--shard auto``, exact by construction) over the
    whole synthetic dataset, serving the splits its trainers hand it (``PoolPolicy``) in ``epoch_order`` (as
    ``--epoch-order``: 1 or 2; 0 chooses as a daemon does).
    ``base_port``: endpoint ``i`` binds ``host:base_port + i``; 0: any free port (the status file says which).
    """

    first: int
    count: int
    of: int
    host: str = "127.0.0.1"
    base_port: int = 0
    records: int = 1024
    batch_size: int = 32
    image_size: int = 8
    classes: int = 10
    seed: int = 0
    sndhwm: int = 2
    status_file: Optional[str] = None
    exact: bool = False
    epochs: Optional[int] = None
    trainer_timeout: float = 10.0
    pool: bool = False
    epoch_order: int = 0

    def __post_init__(self) -> None:
        if not (self.count >= 1 and self.of >= 1 and 0 <= self.first and self.first + self.count <= self.of):
            raise ValueError(f"endpoints {self.first}..{self.first + self.count - 1} are not within a fleet of "
                             f"{self.of}: need count >= 1 and first + count <= of")
        if self.records < 1 or self.batch_size < 1 or self.image_size < 1 or self.classes < 1 or self.sndhwm < 1:
            raise ValueError("records, batch size, image size, classes and sndhwm must each be >= 1")
        if not 0 <= self.base_port <= 65535 - self.of:
            raise ValueError(f"--base-port {self.base_port} leaves no room for {self.of} ports below 65536")
        if self.epoch_order and not self.pool:
            raise ValueError("--epoch-order chooses an elastic pool's order: add --pool (fixed shards serve order 1)")

    @property
    def dataset_records(self) -> int:
        """The synthetic dataset's records: ``records`` per endpoint (a pool's endpoints share all of them)."""
        return self.records * self.of

    def bind(self, shard: int) -> str:
        return f"tcp://{self.host}:{self.base_port + shard if self.base_port else '*'}"

    def producer_config(self, shard: int) -> ProducerConfig:
        """Endpoint ``shard``'s settings as a daemon's, settled (``settled``), for the daemon's choice of policy."""
        return settled(ProducerConfig(SYNTHETIC_DATASET, bind=self.bind(shard), batch_size=self.batch_size,
                                      image_size=self.image_size,
                                      shard=ShardSpec(auto=True) if self.pool else ShardSpec(shard, self.of),
                                      seed=self.seed, sndhwm=self.sndhwm, exact=self.exact, epochs=self.epochs,
                                      trainer_timeout=self.trainer_timeout, epoch_order=self.epoch_order))
