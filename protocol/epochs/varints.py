"""Unsigned LEB128 varints, vectorised: the byte form of ``PositionRanges.to_wire`` (its starts, lengths and gaps).

A parser of untrusted bytes: ``decode_varints`` bounds the count before it allocates, and refuses truncated,
over-long (past ``MAX_VARINT_BYTES``) and non-minimal varints with a ValueError naming which.
"""

from __future__ import annotations

import numpy as np

MAX_VARINT_BYTES = 6  # ceil(41 bits / 7): enough for any value up to 2**40


def encode_varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128, minimal, for uint64 values below 2**42, vectorised over 6 byte columns."""
    lengths = np.ones(len(values), np.int64)
    for group in range(1, MAX_VARINT_BYTES):
        lengths += values >= (1 << (7 * group))
    columns = np.arange(MAX_VARINT_BYTES)
    shifts = (7 * columns).astype(np.uint64)
    table = ((values[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    table |= np.where(columns < lengths[:, None] - 1, 0x80, 0).astype(np.uint8)
    return table[columns < lengths[:, None]].tobytes()


def decode_varints(payload: bytes, max_values: int) -> np.ndarray:
    """The uint64 values of a minimal unsigned LEB128 sequence of at most 6 bytes each; ValueError for a
    truncated, over-long or non-minimal varint, or more than ``max_values`` of them. O(len(payload))."""
    data = np.frombuffer(payload, np.uint8)
    if len(data) == 0:
        return np.zeros(0, np.uint64)
    if data[-1] & 0x80:
        raise ValueError("position ranges: truncated varint at the end")
    last_bytes = np.flatnonzero((data & 0x80) == 0)  # each varint's final byte
    if len(last_bytes) > max_values:
        raise ValueError(f"position ranges: more than {max_values // 2} ranges (max_ranges)")
    first_bytes = np.concatenate(([0], last_bytes[:-1] + 1))
    lengths = last_bytes - first_bytes + 1
    if (lengths > MAX_VARINT_BYTES).any():
        raise ValueError(f"position ranges: a varint longer than {MAX_VARINT_BYTES} bytes (values are <= 2**40)")
    if ((data[last_bytes] == 0) & (lengths > 1)).any():
        raise ValueError("position ranges: a non-minimal varint (a trailing zero group)")
    place = np.arange(len(data)) - np.repeat(first_bytes, lengths)  # byte's index within its varint
    groups = (data & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    return np.add.reduceat(groups, first_bytes)  # groups' bits never overlap: the sum is their OR
