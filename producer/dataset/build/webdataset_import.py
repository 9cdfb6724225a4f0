"""Records from WebDataset tar shards, for ``stoker lmdb build --from webdataset`` (local paths or any fsspec URL).

A WebDataset sample is the run of consecutive tar members that share a *key* (the member name up to the first dot
of its last path component): ``n01440764_10026.jpg`` and ``n01440764_10026.cls`` make one sample. Each sample
becomes a record ``{"image": <the image member's bytes>, "label": <the cls member as an int>}``: the image is the
member with an image extension (jpg, jpeg, png, webp, bmp, gif, tif, tiff), the label the ``cls`` (or
``cls.txt``, ``label``) member's decimal text. The tar is read as a stream (no extraction: nothing reaches the
disk, member names cannot escape anywhere), one member of at most ``MAX_MEMBER_BYTES`` at a time (an extended header of
at most ``MAX_HEADER_BYTES``, checked before tarfile reads it), and a sample
keeps only its image and label members in memory (other members, e.g. ``.json``, are passed over).

Nothing is lost silently: a sample without an image or a label, a label that is not an integer >= 0, a member
that is not a regular file or is too large, an unreadable or truncated tar: each is a ``(position, reason)`` the
builder lists and counts (``TAR:KEY`` or ``TAR:MEMBER``), and the build goes on with the next.
"""

from __future__ import annotations

import tarfile
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from stoker.producer.dataset.sources.lmdb_format import MAX_RECORD_BYTES

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
LABEL_EXTENSIONS = ("cls", "cls.txt", "label")
MAX_MEMBER_BYTES = MAX_RECORD_BYTES
MAX_LABEL = 10**6  # a larger class index is a corrupt label, not a dataset (the builder sizes classes by it)
KEPT = frozenset(IMAGE_EXTENSIONS + LABEL_EXTENSIONS)  # what a sample keeps in memory; other members are passed
MAX_HEADER_BYTES = 1 << 20  # a GNU long name or a pax header: tarfile reads it whole, so it is bounded first
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
             tarfile.SOLARIS_XHDTYPE)


class BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses an extended header (GNU long name, pax) larger than ``MAX_HEADER_BYTES`` before
    tarfile reads it into memory: its size field is the tar's word, not ours to trust."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_HEADER_BYTES:
            raise tarfile.HeaderError(f"an extended header of {self.size} bytes (at most {MAX_HEADER_BYTES})")
        return super()._proc_member(tar)  # type: ignore[misc]

Item = tuple[str, Callable[[], Mapping[str, Any]]]


class _Rejected(ValueError):
    """A sample the builder reports instead of storing (its loader raises this)."""


def _split(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name: ``a/b/key.ext.more`` -> ``("a/b/key", "ext.more")``."""
    folder, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (extension.lower() if dot else "")


def _record(position: str, members: dict[str, bytes]) -> Mapping[str, Any]:
    """The record of one sample's members; _Rejected naming what is missing or wrong."""
    image = next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)
    text = next((members[e] for e in LABEL_EXTENSIONS if e in members), None)
    if image is None:
        raise _Rejected(f"no image member (one of .{', .'.join(IMAGE_EXTENSIONS)}); it has {sorted(members)}")
    if text is None:
        raise _Rejected(f"no label member (.cls); it has {sorted(members)}")
    try:
        label = int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise _Rejected(f"label {text[:32]!r} is not an integer") from None
    if not 0 <= label <= MAX_LABEL:
        raise _Rejected(f"label {label} is outside 0-{MAX_LABEL}")
    return {"image": image, "label": label}


def _rejected(reason: str) -> Callable[[], Mapping[str, Any]]:
    def load() -> Mapping[str, Any]:
        raise _Rejected(reason)
    return load


def tar_items(name: str, stream: Any) -> Iterator[Item]:
    """``(position, load)`` of every sample of one tar read from ``stream`` (a binary file object), in order."""
    key: Optional[str] = None
    members: dict[str, bytes] = {}

    def sample() -> Item:
        record_members, position = dict(members), f"{name}:{key}"
        return position, lambda: _record(position, record_members)

    try:
        with tarfile.open(fileobj=stream, mode="r|*", tarinfo=BoundedTarInfo) as tar:
            for member in tar:
                member_key, extension = _split(member.name)
                if not member.isfile():
                    if not member.isdir():
                        yield f"{name}:{member.name}", _rejected("not a regular file (a link or a device)")
                    continue
                if member.size > MAX_MEMBER_BYTES:
                    yield f"{name}:{member.name}", _rejected(f"{member.size} bytes, more than {MAX_MEMBER_BYTES}")
                    continue
                if member_key != key and members:
                    yield sample()
                    members = {}
                key = member_key
                if extension in KEPT and extension not in members:  # one image and one label per sample at most
                    data = tar.extractfile(member)
                    members[extension] = data.read() if data is not None else b""
                else:
                    members.setdefault(extension, b"")  # named in a rejection, its bytes never read
    except (tarfile.TarError, EOFError, OSError) as exc:
        yield f"{name}", _rejected(f"the tar is unreadable from here on ({type(exc).__name__}: {exc})")
    if members:
        yield sample()


def webdataset_items(sources: Sequence[str], storage_options: Optional[dict[str, Any]] = None) -> Iterator[Item]:
    """Every sample of the tars ``sources`` name: files, folders (their ``*.tar``) or fsspec URLs with globs
    (``s3://bucket/shards/*.tar``), in sorted order. OSError for a source that names nothing."""
    import fsspec

    for source in sources:
        target = source.rstrip("/") + "/*.tar" if not source.endswith(".tar") and "*" not in source else source
        files = fsspec.open_files(target, "rb", **(storage_options or {}))
        if not files:
            raise OSError(f"{source}: no .tar file there (give tar files, a folder of them, or a glob)")
        for opened in sorted(files, key=lambda f: f.path):
            with opened as stream:
                yield from tar_items(opened.path, stream)
