"""A producer daemon's settings (``ProducerConfig``, the flags of ``stoker produce``) and their checks.

``settled(config)`` refuses settings that contradict each other and makes the implied ones explicit (``--epochs``
and ``--shard auto`` are exact mode; a pool's seed is 0 unless given), before anything is opened or bound;
``check_shard_size`` judges the shard once the dataset says how many records it holds. The daemon and
``policy_for`` see only settled settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

from stoker.protocol.curve import CurveServerKeys

from stoker.producer.dataset.sources import RemoteOptions
from stoker.producer.serve.logs import counted
from stoker.producer.serve.sharding import ShardSpec

log = logging.getLogger("stoker.producer")


@dataclass(frozen=True)
class ProducerConfig:
    """Settings of one producer daemon (the flags of ``stoker produce``)."""

    lmdb_path: str
    bind: str = "tcp://*:5555"
    workers: int = 1
    batch_size: int = 64
    image_size: int = 224
    mode: str = "train"
    pipeline: str = "imagenet"
    pipeline_args: tuple[tuple[str, str], ...] = ()
    shard: ShardSpec = ShardSpec()
    seed: Optional[int] = None
    sndhwm: int = 2
    log_interval: float = 10.0
    producer_id: Optional[str] = None
    curve: Optional[CurveServerKeys] = None
    metrics_port: Optional[int] = None
    log_format: str = "text"
    repeat_batches: int = 0
    fast_dct: bool = False
    exact: bool = False
    epochs: Optional[int] = None
    trainer_timeout: float = 10.0
    min_trainers: int = 1
    status_file: Optional[str] = None  # JSON lines for programs (status_file.py's docstring); None: none
    remote: RemoteOptions = RemoteOptions()  # a dataset in object storage: cache, credentials' options, retries
    shuffle_window: int = 1  # a pool on a sharded dataset: shards per shuffle window (``epoch_order``; 0: flat)
    shard_affinity: bool = True  # tell trainers which shards this host caches, so they hand it their splits
    epoch_order: int = 0  # an elastic pool's epoch order (1 or 2); 0: 2 beyond MAX_MATERIALISED_RECORDS, else 1


def settled(config: ProducerConfig) -> ProducerConfig:
    """``config`` with what its flags imply made explicit; ValueError naming the flags for settings that do not
    combine."""
    if config.mode not in ("train", "eval"):
        raise ValueError(f"--mode must be train or eval, got {config.mode!r}")
    if config.workers < 1 or config.batch_size < 1 or config.image_size < 8:
        raise ValueError("--workers and --batch-size must be >= 1 and --image-size >= 8")
    if config.epochs is not None and config.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {config.epochs}")
    if config.epochs is not None and not config.exact:
        config = replace(config, exact=True)  # a finite run is exact: it ends when every record is consumed
    if config.shard.auto:
        if config.min_trainers > 1:
            raise ValueError("--min-trainers does not apply to --shard auto: each trainer hands out its own splits")
        if config.repeat_batches:
            raise ValueError("--repeat-batches is a benchmark of the plain mode; it does not combine with --shard auto")
        # The trainers hand out the splits over exact mode's control channel, and every producer of the pool
        # must order an epoch alike: the same seed (0 unless given).
        config = replace(config, exact=True, seed=config.seed if config.seed is not None else 0)
    if config.min_trainers > 1 and not config.exact:
        raise ValueError("--min-trainers needs exact mode (--exact or --epochs N): plain producers do not know "
                         "their trainers")
    if config.repeat_batches and config.exact:
        raise ValueError("--repeat-batches is a benchmark of the plain mode; it does not combine with --exact")
    return config


def check_shard_size(config: ProducerConfig, records: int) -> None:
    """ValueError for a shard of fewer records than workers; a warning saying what the batches hold for one of fewer
    records than a batch (legal: a small dataset still serves, but not the batches one expects)."""
    said = f"shard {config.shard} of {config.lmdb_path} holds {counted(records, 'record')}"
    if records < config.workers:
        raise ValueError(f"{said}, fewer than --workers {config.workers}")
    if records < config.batch_size and not config.exact:  # each worker's record stream runs on from epoch to epoch
        log.warning("%s, fewer than --batch-size %d: each batch runs over %d epochs or more, so it holds records more "
                    "than once (in train mode each time augmented anew)", said, config.batch_size,
                    -(-config.batch_size // records))
    elif records < config.batch_size:  # EPOCHS_AHEAD (policies/fixed_shards, split_scheduler): 2 epochs open at most
        log.warning("%s, fewer than --batch-size %d: exact mode sends a record once per epoch, so a batch carries at "
                    "most %s and trainers cut its other rows off as padding (smaller steps)", said,
                    config.batch_size, counted(records * min(config.epochs or 2, 2), "sample"))


def pool_order(config: ProducerConfig, records: int) -> int:
    """The epoch order this producer serves (``--epoch-order``); when not given, 2 for an elastic pool beyond
    ``MAX_MATERIALISED_RECORDS``, else 1 (a fixed shard in order 2 is asked for by name: its own records must still
    fit its per-record bookkeeping, which the daemon checks); ValueError for another order."""
    from stoker.protocol.input_state import MAX_MATERIALISED_RECORDS

    order = config.epoch_order or (2 if config.shard.auto and records > MAX_MATERIALISED_RECORDS else 1)
    if order not in (1, 2):
        raise ValueError(f"--epoch-order must be 1 or 2, got {order}")
    return order
