"""Checkpoints of ``stoker train --checkpoint-dir``: the model, the optimizer, the step and the input's state together.

A checkpoint folder holds ``tf.train.CheckpointManager``'s checkpoints (``ckpt-STEP.*``; its ``checkpoint`` index
is replaced atomically after the files are written, so only whole checkpoints are listed) and
``stoker-train.json`` (``RunSettings``, replaced atomically before each checkpoint): what a resumed run must
share with the one that saved it (model, classes, batches, exact mode, share, trainer id) and the streams the
producers served (dataset, shard, seed). ``--resume`` refuses other settings or producers of other streams, saying
which and what to pass; a folder that holds a checkpoint is refused without ``--resume``, so a run never writes
over another's by mistake. The input's state is restored before it receives anything (exact mode: the producers
resume from it), so each record of an epoch is trained once across the restart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import tensorflow as tf

log = logging.getLogger("stoker.consumer")

SETTINGS_FILE = "stoker-train.json"


class CheckpointMismatchError(ValueError):
    """A checkpoint folder that this run may not resume (other settings or producers) or may not write over."""


@dataclass(frozen=True)
class RunSettings:
    """What a resumed run must share with the run that saved its checkpoint; ``streams``: those the producers
    served (``I/N:records:seed`` or ``splits:records:seed``), from their batch headers."""

    model: str
    classes: int
    batch_size: int
    image_shape: tuple[int, int]
    exact: bool
    share: tuple[int, int]
    trainer_id: Optional[str]
    streams: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, text: str, where: str) -> "RunSettings":
        try:
            raw = json.loads(text)
            return cls(model=str(raw["model"]), classes=int(raw["classes"]), batch_size=int(raw["batch_size"]),
                       image_shape=(int(raw["image_shape"][0]), int(raw["image_shape"][1])), exact=bool(raw["exact"]),
                       share=(int(raw["share"][0]), int(raw["share"][1])),
                       trainer_id=None if raw["trainer_id"] is None else str(raw["trainer_id"]),
                       streams=tuple(str(s) for s in raw["streams"]))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise CheckpointMismatchError(f"{where} is not a stoker train settings file ({exc!r}): resume from a "
                                          "folder stoker train --checkpoint-dir wrote") from None

    def mismatches(self, now: "RunSettings") -> list[str]:
        """What differs in ``now`` (a resumed run's settings, ``streams`` those served so far), as flag texts."""
        flags = {"model": "--model", "classes": "--classes", "batch_size": "--batch-size (the producers')",
                 "image_shape": "--image-size (the producers')", "exact": "--exact", "share": "--share",
                 "trainer_id": "--trainer-id"}
        said = [f"{flag} {getattr(now, name)!r}, saved with {getattr(self, name)!r}" for name, flag in flags.items()
                if getattr(now, name) != getattr(self, name)]
        other = sorted(set(now.streams) - set(self.streams))
        if other and self.streams:
            said.append(f"the producers serve {', '.join(other)}, the checkpoint was trained on "
                        f"{', '.join(self.streams)} (another dataset, --seed, --shard or --shuffle-window)")
        return said


class TrainCheckpoints:
    """The checkpoints in ``directory``: ``attach`` what they hold, then ``restore()`` and ``save(step, settings)``."""

    def __init__(self, directory: str, keep: int = 3) -> None:
        self.directory, self.keep = directory, keep
        self._manager: Optional[tf.train.CheckpointManager] = None

    @property
    def latest(self) -> Optional[str]:
        """The newest whole checkpoint's path prefix, or None."""
        return tf.train.latest_checkpoint(self.directory) if os.path.isdir(self.directory) else None

    def saved_settings(self, resume: bool) -> Optional[RunSettings]:
        """The settings of the checkpoint to resume, or None to start afresh (none there). Raises
        CheckpointMismatchError for a folder holding a checkpoint without ``resume``, or without its settings."""
        latest = self.latest
        if latest is None:
            if resume:
                log.info("no checkpoint in %s yet: starting afresh", self.directory)
            return None
        if not resume:
            raise CheckpointMismatchError(f"--checkpoint-dir {self.directory} holds a checkpoint ({os.path.basename(latest)}):"
                                          " pass --resume to continue from it, or give another folder")
        path = os.path.join(self.directory, SETTINGS_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                return RunSettings.from_json(f.read(), path)
        except FileNotFoundError:
            raise CheckpointMismatchError(f"{path} is missing, so {latest} cannot be checked against this run: "
                                          "resume only from a folder stoker train --checkpoint-dir wrote") from None

    def attach(self, **objects: Any) -> None:
        """What each checkpoint holds, e.g. ``model=, optimizer=, step=, input=``."""
        os.makedirs(self.directory, exist_ok=True)
        self._manager = tf.train.CheckpointManager(tf.train.Checkpoint(**objects), self.directory, self.keep)

    def restore(self) -> None:
        """Restore the newest checkpoint into the attached objects (the optimizer already built); every one it
        holds must match (AssertionError naming the object otherwise)."""
        assert self._manager is not None, "attach() first"
        self._manager.checkpoint.restore(self._manager.latest_checkpoint).assert_existing_objects_matched()
        log.info("resumed from %s", self._manager.latest_checkpoint)

    def save(self, step: int, settings: RunSettings) -> str:
        """Write the settings (atomically), then the attached objects as the checkpoint of ``step``; its path."""
        assert self._manager is not None, "attach() first"
        text = json.dumps({**dataclasses.asdict(settings)}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=".stoker-train-", dir=self.directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, SETTINGS_FILE))
        path = self._manager.save(checkpoint_number=step)
        log.info("checkpoint of step %d: %s", step, path)
        return path
