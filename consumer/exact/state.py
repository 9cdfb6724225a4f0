"""Exact mode's input state as bytes: the trainer id and every record its steps consumed.

What ``save_state()`` returns and ``restore_state()`` / ``resume_state=`` take, and what goes into
``tf.train.Checkpoint(input=inp)``: a msgpack map ``{"format", "trainer", "state"}`` (no pickle;
``InputState.from_wire`` validates the rest). ValueError naming what is wrong for anything else.
"""

from __future__ import annotations

import msgpack

from stoker.protocol.input_state import InputState

STATE_FORMAT = "stoker-zmqinput-state"


def pack_state(trainer_id: str, state: InputState) -> bytes:
    return msgpack.packb({"format": STATE_FORMAT, "trainer": trainer_id, "state": state.to_wire()}, use_bin_type=True)


def parse_state(data: bytes) -> tuple[str, InputState]:
    """``(trainer id, input state)`` from ``pack_state`` bytes; ValueError naming what is wrong."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not a ZMQInput state: invalid msgpack ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != STATE_FORMAT or not isinstance(body.get("trainer"), str):
        raise ValueError(f"not a ZMQInput state (format {STATE_FORMAT!r} and a trainer id expected)")
    return body["trainer"], InputState.from_wire(body.get("state"))
