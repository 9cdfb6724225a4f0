"""Producer and trainer ids on the wire: what an id may be, and a producer daemon's id, unique per instance.

A batch header names its producer, an exact-mode hello its trainer; both keep ``is_valid_id``'s rule.
"""

from __future__ import annotations

import re
import secrets

_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")


def is_valid_id(text: object) -> bool:
    """A producer or trainer id: 1-128 printable ASCII characters, no spaces (the one rule for both)."""
    return isinstance(text, str) and _ID_RE.fullmatch(text) is not None


_INSTANCE_RE = re.compile(r"~[0-9a-f]{6}\Z")


def with_instance(place: str) -> str:
    """``place`` (printable ASCII, no spaces) plus ``~`` and 6 random hex digits, cut to the 128-character id
    limit: a producer daemon's default id, one per instance, so no two daemons' batches are counted as one's."""
    suffix = f"~{secrets.token_hex(3)}"
    return place[:128 - len(suffix)] + suffix


def place_of(producer: str) -> str:
    """A producer id without the suffix ``with_instance`` adds: what a producer restarted at the same address and
    shard keeps, so that a restart is not taken for a second producer serving the same shard."""
    return _INSTANCE_RE.sub("", producer)
