"""Wire protocol v1: one batch of named numpy arrays as one ZMQ multipart message.

Frame 0 is a msgpack map (the header); frames 1..n hold the raw little-endian,
C-order bytes of each array, in the order the header lists them. The full
specification, for peers in other languages, is docs/protocol.md.

Encoding hands array buffers to ZMQ without copying (send with ``copy=False``);
decoding validates the header completely *before* touching array bytes and then
builds arrays with ``np.frombuffer`` on the received frames, so no array byte is
copied and no allocation is ever sized by a number read from the wire.
Nothing here uses pickle. What the header's fields may hold, and the types decoding
returns, are in ``batch_header.py``; producer ids in ``peer_ids.py``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

from .batch_header import (
    ALLOWED_DTYPES,
    ARRAY_NAME_RE,
    MAX_CLASSES,
    MAX_HEADER_BYTES,
    MAX_RANK,
    MAX_STREAM_CHARS,
    PROTOCOL_VERSION,
    SOURCE_RULE,
    STAGES_RULE,
    ArraySpec,
    Batch,
    BatchHeader,
    DecodeLimits,
    classes_ok,
    is_int,
    session_ok,
    source_ok,
    stages_ok,
    stream_ok,
)
from .errors import ProtocolError
from .peer_ids import is_valid_id


def encode_batch(
    arrays: Mapping[str, np.ndarray],
    *,
    producer: str,
    seq: int,
    worker: int = 0,
    stages: Mapping[str, float] | None = None,
    stream: str = "",
    classes: int = 0,
    source: str = "",
) -> list[Any]:
    """Return the frames of one batch message: ``[header, array0, array1, ...]``.

    Array frames are the arrays themselves (buffer protocol), not copies: pass the
    list to ``socket.send_multipart(frames, copy=False)`` and do not modify the
    arrays until ZMQ is done with them. Non-contiguous or big-endian arrays are
    converted (that one case copies). ``stages``: seconds spent making the batch, per
    stage (``STAGES``), for the trainer's bottleneck report. ``stream``: the shard the batch
    belongs to (``I/N:records:seed``), so a trainer sees producers whose shards overlap. ``classes``: the classes
    the dataset names (0: not said), so a trainer checks its model against them. ``source``: the dataset served,
    ``"<kind> <location>"`` ("": not said; ``SOURCE_RULE``), which the trainer's stats, metrics and report name.
    Raises ProtocolError for a dtype outside ALLOWED_DTYPES, an invalid name, invalid stage times, a source
    outside its rule or a header over MAX_HEADER_BYTES, so a sender never emits what a receiver would refuse.
    """
    if not is_valid_id(producer):
        raise ProtocolError(f"producer id {producer!r} must be 1-128 printable ASCII characters without spaces")
    if seq < 0:
        raise ProtocolError(f"seq must be >= 0, got {seq}")
    specs = []
    frames: list[Any] = [b""]
    for name, array in arrays.items():
        if not ARRAY_NAME_RE.match(name):
            raise ProtocolError(f"array name {name!r} must match {ARRAY_NAME_RE.pattern}")
        array = np.asarray(array)
        dtype_name = array.dtype.name
        if dtype_name not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {name!r} has dtype {dtype_name}, not one of {sorted(ALLOWED_DTYPES)}")
        if array.dtype.byteorder == ">" or not array.flags.c_contiguous:
            array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        specs.append({"name": name, "dtype": dtype_name, "shape": list(array.shape)})
        frames.append(array)
    header = {
        "v": PROTOCOL_VERSION,
        "producer": producer,
        "seq": int(seq),
        "worker": int(worker),
        "sent_at": time.time(),
        "arrays": specs,
    }
    if stream:
        if not stream_ok(stream):
            raise ProtocolError(f"stream {stream!r} must be at most {MAX_STREAM_CHARS} characters")
        header["stream"] = stream
    if classes:
        if not classes_ok(classes):
            raise ProtocolError(f"classes must be an integer in [0, {MAX_CLASSES}], got {classes!r}")
        header["classes"] = int(classes)
    if source:
        _require(source_ok(source), f"{SOURCE_RULE}, got {source!r:.300}")
        header["source"] = source
    if stages:
        if not stages_ok(dict(stages)):
            raise ProtocolError(f"{STAGES_RULE}, got {dict(stages)!r}")
        header["stages"] = {k: float(v) for k, v in stages.items()}
    frames[0] = msgpack.packb(header, use_bin_type=True)
    _require(len(frames[0]) <= MAX_HEADER_BYTES,
             f"header would be {len(frames[0])} bytes, more than the {MAX_HEADER_BYTES} allowed: send fewer arrays")
    return frames


def with_session(frame: Any, *, stream: str, session: int, limits: DecodeLimits = DecodeLimits()) -> bytes:
    """Frame 0 of a batch with exact mode's ``stream`` and ``session`` set (docs/protocol.md, "Exact mode").

    A producer in exact mode names, on each batch a worker encoded, its stream and the session of the trainer
    it goes to. The other fields stay as they are, in their order (a field already there keeps its place).
    Raises ProtocolError for a frame that is not a header map within the codec's limits, a stream over
    ``MAX_STREAM_CHARS`` characters, a session a receiver would refuse, or a result over ``MAX_HEADER_BYTES``.
    """
    header = _unpack_header(frame, limits)
    _require(stream_ok(stream), f"stream {stream!r} must be at most {MAX_STREAM_CHARS} characters")
    _require(session_ok(session), f"session must be an integer in [-1, 2**31), got {session!r}")
    header["stream"], header["session"] = stream, session
    out = msgpack.packb(header, use_bin_type=True)
    _require(len(out) <= MAX_HEADER_BYTES, f"header would be {len(out)} bytes, more than the {MAX_HEADER_BYTES} allowed")
    return out


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ProtocolError(message)


def _unpack_header(frame: Any, limits: DecodeLimits) -> Any:
    """Frame 0 as a map, within the header's size and msgpack limits; ProtocolError otherwise."""
    raw = memoryview(frame)
    _require(raw.nbytes <= MAX_HEADER_BYTES, f"header frame is {raw.nbytes} bytes, more than the {MAX_HEADER_BYTES} allowed")
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=4096,
            max_bin_len=4096,
            max_array_len=4 * limits.max_arrays + 16,
            max_map_len=64,
            max_ext_len=64,
        )
    except Exception as exc:  # msgpack raises several types for bad input
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    _require(isinstance(header, dict), f"header must be a msgpack map, got {type(header).__name__}")
    return header


def decode_header(frame: Any, limits: DecodeLimits = DecodeLimits()) -> BatchHeader:
    """Parse and validate frame 0. Raises ProtocolError naming the bad field."""
    header = _unpack_header(frame, limits)
    version = header.get("v")
    _require(is_int(version), "header field 'v' (protocol version) is missing or not an integer")
    _require(
        version == PROTOCOL_VERSION,
        f"protocol version {version} is not supported: this receiver speaks version {PROTOCOL_VERSION}; "
        "run the same Stoker release on producers and trainer",
    )
    producer = header.get("producer")
    _require(is_valid_id(producer), f"header field 'producer' is invalid: {producer!r}")
    seq = header.get("seq")
    _require(is_int(seq) and seq >= 0, f"header field 'seq' must be an integer >= 0, got {seq!r}")
    worker = header.get("worker", 0)
    _require(is_int(worker) and 0 <= worker < 2**31, f"header field 'worker' must be a small integer >= 0, got {worker!r}")
    sent_at = header.get("sent_at", 0.0)
    _require(isinstance(sent_at, (int, float)) and not isinstance(sent_at, bool), f"header field 'sent_at' must be a number, got {sent_at!r}")
    stream = header.get("stream", "")
    _require(stream_ok(stream), f"header field 'stream' must be a short string, got {stream!r}")
    session = header.get("session", -1)
    _require(session_ok(session), f"header field 'session' must be an integer, got {session!r}")
    stages = header.get("stages", {})
    _require(stages_ok(stages), STAGES_RULE)
    classes = header.get("classes", 0)
    _require(classes_ok(classes), f"header field 'classes' must be an integer in [0, {MAX_CLASSES}], got {classes!r}")
    source = header.get("source", "")
    _require(source_ok(source), f"{SOURCE_RULE}, got {source!r:.300}")
    specs_raw = header.get("arrays")
    _require(isinstance(specs_raw, list), "header field 'arrays' is missing or not a list")
    _require(len(specs_raw) <= limits.max_arrays, f"header lists {len(specs_raw)} arrays, more than the {limits.max_arrays} allowed")
    specs: list[ArraySpec] = []
    seen: set[str] = set()
    for i, spec in enumerate(specs_raw):
        _require(isinstance(spec, dict), f"arrays[{i}] must be a map")
        name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
        _require(isinstance(name, str) and bool(ARRAY_NAME_RE.match(name)), f"arrays[{i}].name is invalid: {name!r}")
        _require(name not in seen, f"array name {name!r} appears twice")
        seen.add(name)
        _require(isinstance(dtype, str) and dtype in ALLOWED_DTYPES, f"array {name!r} has dtype {dtype!r}, not one of {sorted(ALLOWED_DTYPES)}")
        _require(isinstance(shape, list) and len(shape) <= MAX_RANK, f"array {name!r} shape must be a list of at most {MAX_RANK} dims, got {shape!r}")
        _require(all(is_int(d) and d >= 0 for d in shape), f"array {name!r} shape must hold integers >= 0, got {shape!r}")
        specs.append(ArraySpec(name=name, dtype=dtype, shape=tuple(shape)))
    return BatchHeader(version=version, producer=producer, seq=seq, arrays=tuple(specs), worker=worker,
                       sent_at=float(sent_at), stream=stream, session=session,
                       stages={k: float(v) for k, v in stages.items()}, classes=classes, source=source)


def decode_batch(frames: Sequence[Any], limits: DecodeLimits = DecodeLimits()) -> Batch:
    """Validate a multipart message and return its arrays without copying them.

    ``frames`` are what ``recv_multipart`` returned: bytes or ``zmq.Frame``
    (``copy=False``). The returned arrays are read-only views of those frames and
    keep them alive. Raises ProtocolError on any violation: frame count, total
    size, header fields, dtype outside the allowlist, negative dims, or
    ``prod(shape) * itemsize != len(frame)``.
    """
    _require(len(frames) >= 1, "message has no frames")
    views = [memoryview(f) for f in frames]
    total = sum(v.nbytes for v in views)
    _require(total <= limits.max_message_bytes, f"message is {total} bytes, more than the {limits.max_message_bytes} allowed")
    header = decode_header(views[0], limits)
    _require(
        len(views) == 1 + len(header.arrays),
        f"header lists {len(header.arrays)} arrays but the message has {len(views) - 1} data frames",
    )
    arrays: dict[str, np.ndarray] = {}
    for spec, view in zip(header.arrays, views[1:]):
        _require(
            spec.nbytes == view.nbytes,
            f"array {spec.name!r} declares shape {list(spec.shape)} {spec.dtype} = {spec.nbytes} bytes but its frame has {view.nbytes}",
        )
        arrays[spec.name] = np.frombuffer(view, dtype=spec.wire_dtype).reshape(spec.shape)
    return Batch(header=header, arrays=arrays)
