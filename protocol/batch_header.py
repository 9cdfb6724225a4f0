"""What a batch message holds (wire protocol v1, docs/protocol.md): the header's fields and the rule each one
keeps, the limits every receiver enforces, and the types decoding returns (``BatchHeader``, ``ArraySpec``,
``Batch``).

``batch_codec`` encodes and decodes messages by these rules, so a sender never emits what a receiver would refuse.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROTOCOL_VERSION = 1

#: dtypes a peer may send; everything travels little-endian.
ALLOWED_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "uint64",
        "int64",
        "float16",
        "float32",
        "float64",
    }
)

#: what an array's name may be: a Python identifier of at most 64 characters
ARRAY_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

MAX_HEADER_BYTES = 64 * 1024
MAX_ARRAYS = 64
MAX_RANK = 8
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds a receiver enforces on every message.

    max_message_bytes: total size of all frames (default 512 MiB); also set it as
        ``zmq.MAXMSGSIZE`` on the socket so oversized frames never reach Python.
    max_arrays: most arrays one batch may carry (default 64).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_arrays: int = MAX_ARRAYS


@dataclass(frozen=True)
class ArraySpec:
    """Name, dtype and shape of one array as the header declares it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        # Python ints: no overflow however large the claimed shape is.
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def wire_dtype(self) -> np.dtype:
        """The numpy dtype of its frame's bytes: little-endian, as the wire carries every array."""
        return np.dtype(self.dtype).newbyteorder("<")


@dataclass(frozen=True)
class BatchHeader:
    """The decoded, validated frame 0 of a batch message."""

    version: int
    producer: str
    seq: int
    arrays: tuple[ArraySpec, ...]
    worker: int = 0
    sent_at: float = 0.0
    stream: str = ""  # exact mode: the stream (shard) the batch belongs to
    session: int = -1  # exact mode: the receiving trainer's session it was sent under
    stages: dict[str, float] = field(default_factory=dict)  # seconds the producer spent per stage on it
    classes: int = 0  # classes the producer's dataset names (0: not said), so a trainer can check its own
    source: str = ""  # the dataset the producer serves, "<kind> <location>" ("": not said), for reports and metrics


@dataclass
class Batch:
    """A decoded batch: its header and arrays that view the received frames."""

    header: BatchHeader
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


# ---- the rules of the optional header fields, one each; encoding and decoding both keep them ----

#: The producer stages a batch header may time (``stages``), in pipeline order. ``fetch``: the time its reads
#: waited for object storage (a shard fetched, retries included), sent only when not zero: a trainer older than
#: it refuses a header naming it, so upgrade trainers before producers that read from object storage.
STAGES = ("fetch", "read", "decode", "augment", "send")


def stages_ok(stages: Any) -> bool:
    """The rule of the header field ``stages`` (``STAGES_RULE``)."""
    return isinstance(stages, dict) and all(
        k in STAGES and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6
        for k, v in stages.items())


STAGES_RULE = f"header field 'stages' must map stage names among {list(STAGES)} to seconds in [0, 1e6)"
MAX_STREAM_CHARS = 64


def stream_ok(stream: Any) -> bool:
    """The rule of ``stream`` (exact mode's shard): a string of at most ``MAX_STREAM_CHARS``."""
    return isinstance(stream, str) and len(stream) <= MAX_STREAM_CHARS


MAX_CLASSES = 10**7


def classes_ok(classes: Any) -> bool:
    """The rule of ``classes``: an integer in [0, ``MAX_CLASSES``] (0: not said)."""
    return is_int(classes) and 0 <= classes <= MAX_CLASSES


MAX_SOURCE_CHARS = 256


def source_ok(source: Any) -> bool:
    """The rule of ``source`` (``SOURCE_RULE``): a string of at most ``MAX_SOURCE_CHARS`` printable ASCII
    characters, spaces included ("" for not said)."""
    # isascii and isprintable together admit exactly " " to "~", in C: this runs on every batch decoded
    return isinstance(source, str) and len(source) <= MAX_SOURCE_CHARS and source.isascii() and source.isprintable()


SOURCE_RULE = (f"header field 'source' must be a string of at most {MAX_SOURCE_CHARS} printable ASCII characters "
               "(the dataset served, '<kind> <location>')")


def session_ok(session: Any) -> bool:
    """The rule of ``session`` (exact mode): an integer in [-1, 2**31), -1 for none."""
    return is_int(session) and -1 <= session < 2**31


def is_int(value: Any) -> bool:
    """An integer field as msgpack gives it: an ``int``, and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
