"""A WebDataset member's extension as a record field, and its bytes as the field's value, checked.

By extension: ``jpg``/``jpeg``/``png``/``webp`` -> field ``image`` (kind ``image``, the bytes as stored); ``txt`` ->
``text`` (``str``, valid UTF-8); ``cls`` -> ``label`` (``int``, ASCII decimal 0..``MAX_LABEL``); ``json`` -> ``json``
(``map``: a JSON object of at most ``MAX_JSON_BYTES`` nested at most ``MAX_JSON_DEPTH`` deep, the depth counted
before ``json.loads`` sees it); any other extension -> a field of that name (``bytes``), characters outside
``[A-Za-z0-9_]`` made ``_`` (``seg.png`` -> ``seg_png``) and ``x_`` put before a name that starts with a digit or
is one of the four above. A value that breaks its rule is a ``ValueError`` saying why (the reader names the sample).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
NAMED = {"txt": ("text", "str"), "cls": ("label", "int"), "json": ("json", "map"),
         **{e: ("image", "image") for e in IMAGE_EXTENSIONS}}
RESERVED = {name for name, _ in NAMED.values()}
MAX_LABEL = 10**6
MAX_LABEL_BYTES = 32
MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
_NOT_NAME = re.compile(r"[^A-Za-z0-9_]")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def field_of(extension: str) -> tuple[str, str]:
    """``(field name, kind)`` of a member extension (module doc)."""
    if extension in NAMED:
        return NAMED[extension]
    name = _NOT_NAME.sub("_", extension)[:62]
    if not name or name[0].isdigit() or name in RESERVED:
        name = "x_" + name
    return name, "bytes"


def label_value(data: bytes) -> int:
    if len(data) > MAX_LABEL_BYTES or not data.strip().isdigit() or not data.strip().isascii():
        raise ValueError(f"label {data[:MAX_LABEL_BYTES]!r} is not an ASCII integer")
    label = int(data.strip())
    if label > MAX_LABEL:
        raise ValueError(f"label {label} is outside 0..{MAX_LABEL}")
    return label


def json_depth(data: bytes) -> int:
    """How deep ``data``'s brackets nest, strings left out: counted with NumPy, no recursion however deep."""
    codes = np.frombuffer(_JSON_STRING.sub(b'""', data), np.uint8)
    steps = np.isin(codes, _OPEN).astype(np.int32) - np.isin(codes, _CLOSE)
    return int(np.cumsum(steps).max(initial=0))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def map_value(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"a .json member of {len(data)} bytes (at most {MAX_JSON_BYTES})")
    # fewer brackets than the limit cannot nest past it (a typical img2dataset .json has one pair): the count is a
    # C loop, the NumPy depth walk costs ~25 us a member
    opened = data.count(b"{") + data.count(b"[")
    depth = json_depth(data) if opened > MAX_JSON_DEPTH else opened
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"a .json member nested {depth} deep (at most {MAX_JSON_DEPTH})")
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"a .json member that is not JSON ({str(exc)[:120]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a .json member holding a {type(value).__name__}, not an object")
    return value


def text_value(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"a .txt member that is not UTF-8 ({exc.reason} at byte {exc.start})") from None


def value_of(kind: str, data: bytes) -> Any:
    """The value of a member of field kind ``kind``; ValueError naming what is wrong."""
    if kind == "str":
        return text_value(data)
    if kind == "int":
        return label_value(data)
    if kind == "map":
        return map_value(data)
    if not data:
        raise ValueError("an empty member" + (" (an empty file is not an image)" if kind == "image" else ""))
    return data
