"""Exact mode's input state as bytes: the trainer id and every record its steps consumed.

What ``save_state()`` returns and ``restore_state()`` / ``resume_state=`` take, and what goes into
``tf.train.Checkpoint(input=inp)``: a msgpack map (no pickle; ``InputState.from_wire`` validates the
records) of

- ``format``, ``trainer`` (the id), ``state`` (the records): every version;
- ``share``: ``[rank, world]``, the trainer's share of an elastic pool when it saved, and ``splits``:
  ``{pool stream: records per split}``, how its epochs were cut. Together they say which records a
  *completed* epoch of this trainer covered (its share's, not the dataset's), which merging the states of
  several ranks needs (``state_merge.py``). Absent in states of older versions: read as ``[0, 1]``, ``{}``.
- ``trainers``: a *job state* (``merge_states``), the ids of the job's ranks by rank; its records are
  every rank's, so any rank of any number of trainers may continue from it.

ValueError naming what is wrong for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgpack

from stoker.protocol.batch_codec import is_valid_id
from stoker.protocol.input_state import InputState

STATE_FORMAT = "stoker-zmqinput-state"
MAX_TRAINERS = 4096


@dataclass
class SavedState:
    """One state as saved: see the module doc. ``trainers`` is None for one trainer's own state."""

    trainer: str
    state: InputState
    share: tuple[int, int] = (0, 1)
    splits: dict[str, int] = field(default_factory=dict)
    trainers: Optional[list[str]] = None

    @property
    def is_job_state(self) -> bool:
        """Whether this holds every rank's records (merged, or saved by a trainer alone in its job)."""
        return self.trainers is not None or self.share[1] == 1


def pack_state(saved: SavedState) -> bytes:
    body: dict = {"format": STATE_FORMAT, "trainer": saved.trainer, "state": saved.state.to_wire(),
                  "share": list(saved.share), "splits": dict(saved.splits)}
    if saved.trainers is not None:
        body["trainers"] = list(saved.trainers)
    return msgpack.packb(body, use_bin_type=True)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_state(data: bytes) -> SavedState:
    """The ``pack_state`` bytes, checked; ValueError naming what is wrong."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not a ZMQInput state: invalid msgpack ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != STATE_FORMAT or not isinstance(body.get("trainer"), str):
        raise ValueError(f"not a ZMQInput state (format {STATE_FORMAT!r} and a trainer id expected)")
    state = InputState.from_wire(body.get("state"))
    share = body.get("share", [0, 1])
    if (not isinstance(share, list) or len(share) != 2 or not all(map(_int, share))
            or not 0 <= share[0] < share[1] <= MAX_TRAINERS):
        raise ValueError(f"input state: 'share' {share!r} is not [rank, world] with 0 <= rank < world")
    splits = body.get("splits", {})
    if not isinstance(splits, dict) or not all(
            isinstance(k, str) and k in state.streams and _int(v) and v >= 1 for k, v in splits.items()):
        raise ValueError("input state: 'splits' must map streams of the state to a split size >= 1")
    trainers = body.get("trainers")
    if trainers is not None and (not isinstance(trainers, list) or not 1 <= len(trainers) <= MAX_TRAINERS
                                 or not all(isinstance(t, str) and is_valid_id(t) for t in trainers)
                                 or len(set(trainers)) != len(trainers)):
        raise ValueError(f"input state: 'trainers' must list 1-{MAX_TRAINERS} distinct trainer ids")
    return SavedState(body["trainer"], state, (share[0], share[1]), splits, trainers)
