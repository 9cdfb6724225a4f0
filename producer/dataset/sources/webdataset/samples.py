"""A tar's members grouped into WebDataset samples, held as a few NumPy arrays (no Python object per sample).

A sample is a run of consecutive members sharing a *key*: the member name up to the first dot of its last path
component, folders included (``a/b/000123.jpg`` -> key ``a/b/000123``, extension ``jpg``), as webdataset groups
them. Extensions are lower-cased. A member whose base name has no dot, starts with one or ends with one has no
key and is passed over, counted; so is a second member of one extension in one sample (webdataset refuses the
tar there; one sample's bytes are kept). ``SampleBuilder`` takes the walk's members; ``finish`` gives a
``SampleIndex``. After a walk that ended early the last sample is dropped (its members may not all be there)
unless a member of another key came after it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable

import numpy as np

MAX_EXTENSIONS = 256  # distinct extensions in one tar: each is a field; members of any more are passed over


def split_name(name: bytes) -> tuple[bytes, bytes]:
    """``(key, extension)`` of a member name, extension lower-cased; ``(b"", b"")`` if it has no key."""
    slash = name.rfind(b"/") + 1
    dot = name.find(b".", slash)
    if dot <= slash or dot == len(name) - 1:
        return b"", b""
    return name[:dot], name[dot + 1:].lower()


@dataclass(frozen=True)
class SampleIndex:
    """Where each sample's members are: sample ``i`` is members ``starts[i]:starts[i + 1]``, member ``m``'s bytes
    ``sizes[m]`` at ``offsets[m]``, its extension ``extensions[kinds[m]]``; its key ``keys[key_ends[i-1]:key_ends[i]]``."""

    offsets: np.ndarray  # int64, per member
    sizes: np.ndarray  # uint32, per member
    kinds: np.ndarray  # uint16, per member: index into extensions
    starts: np.ndarray  # uint32, per sample + 1
    key_ends: np.ndarray  # uint32, per sample
    keys: bytes | bytearray  # every key, end to end (never changed once built)
    extensions: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def key(self, index: int) -> str:
        lo = int(self.key_ends[index - 1]) if index else 0
        return self.keys[lo:int(self.key_ends[index])].decode(errors="replace")

    def extensions_used(self) -> list[str]:
        """The extensions some member of some sample has."""
        return [self.extensions[k] for k in np.unique(self.kinds)]

    def extension_counts(self) -> dict[str, int]:
        """How many samples have a member of each extension (a sample holds each extension once: the walk keeps the
        first of a repeated one)."""
        counts = np.bincount(self.kinds, minlength=len(self.extensions)) if len(self.kinds) else ()
        return {self.extensions[k]: int(n) for k, n in enumerate(counts) if n}


class SampleBuilder:
    """Groups a walk's members into samples (module doc); ``skip(name, why)`` counts what is passed over."""

    def __init__(self, skip: Callable[[bytes, str], None]) -> None:
        self._skip = skip
        self._offsets, self._sizes, self._kinds = array("q"), array("I"), array("H")  # sizes: <= 64 MiB each
        # a tar holds <= 4 * 10^6 members (TarLimits) of names <= 1024 bytes: member and key-byte counts fit 32 bits
        self._starts, self._key_ends, self._keys = array("I"), array("I"), bytearray()
        self._extensions: dict[bytes, int] = {}
        self._key: bytes = b""
        self._seen: set[int] = set()  # extensions of the sample being grouped

    def add(self, name: bytes, offset: int, size: int) -> tuple[bytes, bytes]:
        """Take one member; ``(key, extension)`` if it joined a sample, ``(b"", b"")`` if passed over."""
        key, extension = split_name(name)
        if not key:
            self._skip(name, "no key.extension name (webdataset passes it over)")
            return b"", b""
        kind = self._extensions.get(extension)
        if kind is None:
            if len(self._extensions) >= MAX_EXTENSIONS:
                self._skip(name, f"more than {MAX_EXTENSIONS} distinct extensions in one tar")
                return b"", b""
            kind = self._extensions[extension] = len(self._extensions)
        if key != self._key or not self._starts:
            self._starts.append(len(self._offsets))
            self._keys += key
            self._key_ends.append(len(self._keys))
            self._key, self._seen = key, set()
        elif kind in self._seen:
            self._skip(name, f"a second .{extension.decode(errors='replace')} member in sample "
                       f"{key[:200].decode(errors='replace')!r}")
            return b"", b""
        self._seen.add(kind)
        self._offsets.append(offset)
        self._sizes.append(size)
        self._kinds.append(kind)
        return key, extension

    def finish(self, whole: bool, cut: bytes = b"") -> SampleIndex:
        """The index. After a walk that ended early (``whole`` False) the last sample may lack members and is
        dropped, counted, unless ``cut`` (the member the tar's end cut short) has another key: then the sample
        before it was closed by that key and is whole. A walk that yields a cut member before it finds it cut
        (a stream) and one that refuses it first (a file) keep the same samples."""
        starts, key_ends = self._starts, self._key_ends
        members = len(self._offsets)
        cut_key = split_name(cut)[0]
        if not whole and starts and (not cut_key or cut_key == self._key):
            members = starts.pop()
            self._skip(self._keys[(key_ends[-2] if len(key_ends) > 1 else 0):key_ends.pop()],
                       "the last sample before the tar became unreadable (it may lack members)")
        starts.append(members)
        del self._keys[key_ends[-1] if key_ends else 0:]
        # views of the arrays, no copies: an index of 10^5 members stays ~3 MB at its peak
        return SampleIndex(_view(self._offsets, np.int64, members), _view(self._sizes, np.uint32, members),
                           _view(self._kinds, np.uint16, members), _view(starts, np.uint32, len(starts)),
                           _view(key_ends, np.uint32, len(key_ends)), self._keys,
                           tuple(e.decode("ascii", "replace") for e in self._extensions))


def _view(values: array, dtype: type, length: int) -> np.ndarray:
    return np.frombuffer(values, dtype)[:length] if length else np.zeros(0, dtype)
