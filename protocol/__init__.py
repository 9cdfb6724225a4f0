"""Stoker wire protocol v1 (see docs/protocol.md). Imported by producer and consumer, never the reverse."""

from .batch_codec import decode_batch, decode_header, encode_batch
from .batch_header import (
    ALLOWED_DTYPES,
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ArraySpec,
    Batch,
    BatchHeader,
    DecodeLimits,
)
from .errors import ProtocolError

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "ArraySpec",
    "Batch",
    "BatchHeader",
    "DecodeLimits",
    "ProtocolError",
    "decode_batch",
    "decode_header",
    "encode_batch",
]
