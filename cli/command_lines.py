"""Command lines of ``stoker produce`` and ``stoker train`` for launchers, from typed arguments.

The one place a launcher (``stoker cluster``, the demo, ``ProducerProcess``) spells these
commands' flags, so a renamed flag is changed here and in its family's ``flags.py`` only. Producers:
``produce_flags``/``produce_command`` live beside ``ProducerProcess`` (``stoker.producer.produce_command``:
the producer must not import the CLI) and are re-exported here; trainers: ``train_command``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from stoker.producer.produce_command import produce_command, produce_flags

__all__ = ["produce_command", "produce_flags", "train_command"]


def train_command(connect: Sequence[str] | str, *, model: str, steps: int, batch_size: int, image_size: int,
                  classes: int, queue_capacity: Optional[int] = None, exact: bool = False,
                  trainer_id: Optional[str] = None, discover_every: Optional[float] = None,
                  share: Optional[tuple[int, int]] = None, log_consumed: Optional[str | os.PathLike] = None,
                  no_progress: bool = False) -> list[str]:
    """The argv of ``stoker train`` run by this Python interpreter; ``connect`` is one address or name, or several
    (joined with commas); ``None``/``False`` leaves a flag out (its default)."""
    addresses = connect if isinstance(connect, str) else ",".join(connect)
    argv = [sys.executable, "-m", "stoker.cli.main", "train", "--connect", addresses, "--model", model,
            "--steps", str(steps), "--batch-size", str(batch_size), "--image-size", str(image_size),
            "--classes", str(classes)]
    if queue_capacity is not None:
        argv += ["--queue-capacity", str(queue_capacity)]
    if no_progress:
        argv.append("--no-progress")
    if discover_every is not None:
        argv += ["--discover-every", f"{discover_every:g}"]
    if share is not None:
        argv += ["--share", f"{share[0]}/{share[1]}"]
    if exact:
        argv.append("--exact")
    if trainer_id is not None:
        argv += ["--trainer-id", trainer_id]
    if log_consumed is not None:
        argv += ["--log-consumed", str(log_consumed)]
    return argv
