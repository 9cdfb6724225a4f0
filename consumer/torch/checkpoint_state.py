"""The input state as a PyTorch ``state_dict``: ``save_state()``'s bytes in a dict of plain types.

``{"stoker_input_state": <bytes>, "version": 1}`` is what ``TorchInput.state_dict()`` returns and
``load_state_dict()`` takes, so ``torch.save(inp.state_dict(), f)`` and ``torch.distributed.checkpoint``'s
``Stateful`` protocol (``dcp.save({"input": inp, ...})``, ``dcp.load(...)``) both carry it as they carry
any other state (torchdata's ``StatefulDataLoader`` keeps its state the same way). The bytes inside are
exactly ``save_state()``'s: the trainer id and the records its steps consumed, nothing framework-specific.
No torch import: these are plain Python values.
"""

from __future__ import annotations

from typing import Any, Mapping

STATE_KEY = "stoker_input_state"
STATE_VERSION = 1


def state_dict_of(state: bytes) -> dict[str, Any]:
    """The state dict holding ``save_state()``'s bytes."""
    return {STATE_KEY: state, "version": STATE_VERSION}


def state_bytes(state_dict: Any) -> bytes:
    """The ``save_state()`` bytes inside a state dict; ValueError naming what is wrong with any other value."""
    expected = f"{{{STATE_KEY!r}: bytes, 'version': {STATE_VERSION}}} as TorchInput.state_dict() returns it"
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"load_state_dict() takes {expected}, not a {type(state_dict).__name__}")
    missing = [key for key in (STATE_KEY, "version") if key not in state_dict]
    unknown = sorted(str(key) for key in state_dict if key not in (STATE_KEY, "version"))
    if missing or unknown:
        raise ValueError(f"load_state_dict() takes {expected}; this one has keys {sorted(map(str, state_dict))}"
                         + (f", missing {missing}" if missing else "") + (f", unknown {unknown}" if unknown else ""))
    version = state_dict["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"load_state_dict(): 'version' is {version!r}, not a version number (this Stoker writes "
                         f"{STATE_VERSION})")
    if version > STATE_VERSION:
        raise ValueError(f"load_state_dict(): the state is version {version}, written by a newer Stoker; this one "
                         f"reads version {STATE_VERSION}: upgrade Stoker on this trainer")
    state = state_dict[STATE_KEY]
    if not isinstance(state, (bytes, bytearray, memoryview)):
        raise ValueError(f"load_state_dict(): {STATE_KEY!r} is a {type(state).__name__}, not the bytes "
                         "save_state() gives")
    return bytes(state)
