"""A manifest's shard list checked and made a ``ShardTable`` column by column: one pass of Python over the JSON's
dicts to take each field out, then NumPy checks over whole columns (a per-shard regex over 10^6 names cost seconds).
The same checks (``checked_table``) run on the columns of the compact form (``compact.py``), so both say one thing."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from stoker.producer.dataset.sources.shard_table.table import ShardTable

__all__ = ["table_of_json", "checked_table", "MAX_OBJECT_PATH", "MAX_SHARD_RECORDS"]

MAX_OBJECT_PATH = 1024  # characters of a tar or Parquet shard's name (its path under the root)
MAX_SHARD_RECORDS = 10 ** 8  # lmdb_format.MAX_LMDB_RECORDS: a shard's records, below
_PRINTABLE = np.zeros(256, bool)
_PRINTABLE[0x20:0x7f] = True
_PRINTABLE[0x5c] = False  # the backslash: one spelling of a path on every OS
_HEX = np.zeros(256, bool)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = True
_DIGIT = np.zeros(256, bool)
_DIGIT[np.frombuffer(b"0123456789", np.uint8)] = True
Bad = Callable[[str], Exception]


def table_of_json(shards: list, shard_format: str, shard_ok: Callable[[Any], bool], bad: Bad) -> ShardTable:
    """The table of a manifest's ``"shards"`` list, checked: on any failure ``shard_ok`` (the per-shard check,
    the reference) finds the first bad shard to name; ``bad(why)`` makes the error raised."""
    try:
        names = [s["name"] for s in shards]
        records = [s["records"] for s in shards]
        sizes = [s["bytes"] for s in shards]
        shas = [s["sha256"] for s in shards]
        typed = (all(type(n) is str for n in names) and all(type(r) is int for r in records)
                 and all(type(b) is int for b in sizes) and all(type(h) is str for h in shas))
        table = _columns(names, records, sizes, shas) if typed else None
    except (TypeError, KeyError, ValueError, OverflowError, UnicodeEncodeError):
        table = None
    why = None if table is None else checked_table(table, shard_format)
    if table is None or why is not None:
        first_bad = next((i for i, s in enumerate(shards) if not shard_ok(s)), None)
        if first_bad is not None:
            name = ("shard-NNNNN" if shard_format == "lmdb" else
                    f"a relative path of printable ASCII, no '..', '.' or empty parts, no backslash, at most "
                    f"{MAX_OBJECT_PATH} characters")
            raise bad(f"shard {first_bad} must be {{name: {name}, records: int, bytes: int, sha256: hex}} (records "
                      f"below 10^8 a shard)")
        raise bad(why or "a shard's records or bytes are past 2^63")
    return table


def _columns(names: list, records: list, sizes: list, shas: list) -> Optional[ShardTable]:
    if any(len(h) != 64 for h in shas):
        return None
    hex_text = "".join(shas).encode("ascii")
    if not _HEX[np.frombuffer(hex_text, np.uint8)].all():  # bytes.fromhex would take capitals and spaces
        return None
    blob = "".join(names).encode("ascii")
    return ShardTable(blob, np.cumsum(np.fromiter(map(len, names), np.int64, len(names))),
                      np.array(records, np.int64), np.array(sizes, np.int64),
                      np.frombuffer(bytes.fromhex(hex_text.decode("ascii")), np.uint8))


def checked_table(table: ShardTable, shard_format: str) -> Optional[str]:
    """What is wrong with ``table`` as a manifest of ``shard_format`` shards, None for nothing: records below
    10^8 and bytes not negative, names the format's (distinct; lmdb: ``shard-NNNNN``; else a relative path of
    printable ASCII but the backslash, no empty, ``.`` or ``..`` part, at most 1024 characters)."""
    n = len(table)
    ends = table.name_ends
    if len(ends) != n or len(table.bytes) != n or table.sha256.shape != (n, 32):
        return "the shard columns differ in length"
    if (table.records < 0).any() or (table.records >= MAX_SHARD_RECORDS).any() or (table.bytes < 0).any():
        return "a shard's records are outside 0 to 10^8, or its bytes negative"
    lengths = np.diff(ends, prepend=0)
    if n and (ends[-1] != len(table.names) or (lengths < 1).any()):
        return "a shard's name is empty"
    raw = np.frombuffer(table.names, np.uint8)
    # The names one a line (a newline is in no name that passes): where a part's bounds are '/' or a newline
    joined = np.insert(raw, ends[:-1], ord("\n")).tobytes()
    why = _lmdb_names(raw, lengths) if shard_format == "lmdb" else _object_paths(raw, lengths, joined)
    if why is None and len(set(joined.split(b"\n"))) != n:  # the one list of names made: ~90 B a shard, briefly
        return "two shards have one name"
    return why


def _lmdb_names(raw: np.ndarray, lengths: np.ndarray) -> Optional[str]:
    starts = np.cumsum(lengths) - lengths
    ok = ((lengths >= 11) & (lengths <= 12)).all()
    if ok:
        prefix = raw[starts[:, None] + np.arange(6)]
        digit = np.ones(len(raw), bool)
        digit[starts[:, None] + np.arange(6)] = False  # every byte past the prefix must be a digit
        ok = bool((prefix == np.frombuffer(b"shard-", np.uint8)).all() and (_DIGIT[raw] | ~digit).all())
    return None if ok else "a shard's name is not shard-NNNNN"


def _object_paths(raw: np.ndarray, lengths: np.ndarray, joined: bytes) -> Optional[str]:
    if (lengths > MAX_OBJECT_PATH).any() or not _PRINTABLE[raw].all():
        return (f"a shard's name is over {MAX_OBJECT_PATH} characters or not printable ASCII (or holds a "
                "backslash)")
    text = b"\n" + joined + b"\n"
    for part in (b"\n/", b"/\n", b"//", b"/./", b"\n./", b"/.\n", b"\n.\n", b"/../", b"\n../", b"/..\n", b"\n..\n"):
        if part in text:
            return "a shard's name has an empty, '.' or '..' part: names are paths under the root"
    return None

