"""``policy_for``: the one place a daemon's settings choose its serving policy (a new policy is added here).

- plain mode (no ``--exact``, no ``--epochs``): ``PlainPolicy``;
- ``--shard auto`` (an elastic pool, exact by construction): ``PoolPolicy``;
- exact mode on a fixed ``--shard I/N``: ``FixedShardPolicy``.
"""

from __future__ import annotations

from typing import Callable, Optional

from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.policies.fixed_shards import FixedShardPolicy
from stoker.producer.serve.policies.plain import PlainPolicy
from stoker.producer.serve.policies.pool import PoolPolicy, ShardCacheView
from stoker.producer.serve.policies.serving_policy import ServingPolicy
from stoker.producer.serve.producer_config import ProducerConfig


def policy_for(config: ProducerConfig, stream: StreamKey, producer_id: str, spec: list[tuple[str, str, list[int]]],
               cache: Optional[ShardCacheView] = None, storage: Callable[[], str] = lambda: "") -> ServingPolicy:
    """The serving policy for a daemon's settled settings (``settled(config)``: ``exact`` already set for
    ``--epochs`` and ``--shard auto``). ``stream``: what it serves; ``spec``: its batches' arrays, said in
    statuses; ``cache``: a sharded dataset's cache (a pool says what it holds); ``storage``: what its workers
    wait on object storage for."""
    if not config.exact:
        return PlainPolicy()
    if config.shard.auto:
        return PoolPolicy(stream, producer_id, config.epochs, config.trainer_timeout, spec, make_ahead=config.workers,
                          cache=cache, say_cache=config.shard_affinity, storage=storage)
    return FixedShardPolicy(stream, producer_id, config.epochs, config.trainer_timeout, spec, config.min_trainers,
                            storage=storage)
