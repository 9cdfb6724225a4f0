"""``stoker produce`` command lines built from typed arguments: the one place that spells its flags for launchers.

``ProducerProcess`` (process.py), ``stoker cluster`` and the demo use them; ``stoker.cli.command_lines`` adds
``stoker train``. The flags are parsed back by ``stoker.cli``'s parser (tests/cli/test_cli_status_file.py holds both
ends together).
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def produce_flags(*, workers: Optional[int] = None, batch_size: Optional[int] = None,
                  image_size: Optional[int] = None, mode: Optional[str] = None, shard: Optional[str] = None,
                  seed: Optional[int] = None, producer_id: Optional[str] = None, epochs: Optional[int] = None,
                  min_trainers: Optional[int] = None, repeat_batches: Optional[int] = None,
                  parent_pid: Optional[int] = None, status_file: Optional[str | os.PathLike] = None,
                  exact: bool = False, trainer_timeout: Optional[float] = None) -> list[str]:
    """``stoker produce`` flags for the given settings, in this order; ``None`` leaves a flag out (its default)."""
    values: list[tuple[str, object]] = [
        ("--workers", workers), ("--batch-size", batch_size), ("--mode", mode), ("--image-size", image_size),
        ("--shard", shard), ("--seed", seed), ("--id", producer_id), ("--epochs", epochs),
        ("--min-trainers", min_trainers), ("--repeat-batches", repeat_batches), ("--parent-pid", parent_pid),
        ("--status-file", status_file), ("--trainer-timeout", trainer_timeout),
    ]
    flags = [text for flag, value in values if value is not None for text in (flag, str(value))]
    return flags + (["--exact"] if exact else [])


def produce_command(lmdb_path: str | os.PathLike, bind: str, flags: Sequence[str] = ()) -> list[str]:
    """The argv of ``stoker produce --lmdb LMDB_PATH --bind BIND FLAGS...`` run by this Python interpreter."""
    return [sys.executable, "-m", "stoker.cli.main", "produce", "--lmdb", str(lmdb_path), "--bind", bind, *flags]
