"""The control messages of exact mode (docs/protocol.md), trainer DEALER <-> producer ROUTER.

In exact mode one connection carries both directions. Trainer to producer, one
msgpack frame each:

- ``hello``: who the trainer is (a stable id), its session (bumped on every hello;
  batches sent under an older session are dropped), how many batches it can take
  (credit), its input state (consumed records: since issue 41 only the stream that producer serves) and the
  records it holds
  (received, not yet consumed), by stream; and how often it wants a status that says nothing new
  (``status_s``, absent from an older trainer: every second).
- ``credit``: ``n`` more batches may come; the records consumed since the last
  message, by epoch. Sent after each batch is queued and as a heartbeat.
- ``describe``: asks for the producer's status (with its batch spec) without joining.
- ``work`` (elastic pools, ``--shard auto``): splits of epochs this producer is to serve to this
  trainer: ``[epoch, start, end, skip]`` = positions ``start..end-1`` of the epoch's order of the
  whole dataset, less the offsets in ``skip`` (records the trainer already has); ``finished``:
  the trainer has every record of its run and wants nothing more.
- ``goodbye``: the trainer leaves (its input closed): the producer forgets it at once, what it held
  is served to the others, and it answers with a status of session 0, which the trainer waits for
  before it closes the connection. Sent only to a producer whose status says it takes one
  (``goodbye``): an older producer counts an unknown message type as a bad message.

Producer to trainer: batches (protocol v1 with ``stream`` and ``session`` header
fields) and ``status``: the stream key, epochs completed, the run's length and
whether the producer has finished, whether it takes a goodbye, and its trainer timeout. Every field is validated; anything else raises
ProtocolError naming it. Nothing is unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np

from .peer_ids import is_valid_id
from .errors import ProtocolError
from .input_state import MAX_RECORDS, InputState

MAX_CONTROL_BYTES = 256 * 1024 * 1024
MAX_ROWS = 1 << 20

Records = list[tuple[int, list[int]]]  # [(epoch, [record indices])]


@dataclass
class Hello:
    trainer: str
    session: int
    credit: int
    state: InputState
    held: dict[str, Records] = field(default_factory=dict)  # stream key -> records received, not consumed
    #: how often the trainer wants a status that says nothing new (liveness; a change goes at once): ``STATUS_S``
    #: from an older trainer, which sends none
    status_s: float = 1.0


#: A status that says nothing new goes at least this often, at most ``MAX_STATUS_S`` apart (a hello's ``status_s``).
STATUS_S = 1.0
MAX_STATUS_S = 30.0


@dataclass
class Credit:
    session: int
    n: int
    consumed: Records = field(default_factory=list)


MAX_SPLIT = 1 << 16  # records in one work item
MAX_WORK_ITEMS = 64


@dataclass
class WorkItem:
    epoch: int
    start: int
    end: int
    skip: list[int] = field(default_factory=list)  # offsets in [0, end - start) not to serve


@dataclass
class Work:
    session: int
    items: list[WorkItem] = field(default_factory=list)
    finished: bool = False


@dataclass
class Goodbye:
    """The trainer of ``session`` leaves: its input closed. Best effort: a trainer that dies says nothing."""

    session: int


@dataclass
class Describe:
    """Asks a producer for its status, batch spec included, without joining (no state, no credit)."""


@dataclass
class Status:
    stream: str
    producer: str
    completed: int
    epochs: Optional[int]
    finished: bool
    spec: list[tuple[str, str, list[int]]] = field(default_factory=list)  # the batches' arrays: name, dtype, shape
    waiting: int = 0  # trainers still to join before it serves anything (--min-trainers)
    session: int = 0  # the addressed trainer's session it was sent under; 0: before it joined (a describe's answer)
    stranger: bool = False  # the answer to credit or work from a trainer this producer does not know: say hello
    #: it has nothing to serve now: every record of its open epochs is out, and it waits for trainers (this one or
    #: others) to consume them (the one-epoch-ahead window); a fixed-shard trainer does not take it for stuck
    idle: bool = False
    #: it takes a trainer's ``goodbye`` (a producer of an older release does not: it would count one as a bad message)
    goodbye: bool = False
    #: an elastic pool's producer of a sharded dataset in object storage: the shards its cache holds at most (None:
    #: every shard is on its disk) and those it holds now (at most ``MAX_HELD``): the trainer hands it their splits
    cache: Optional[int] = None
    held: list[int] = field(default_factory=list)
    #: records of its stream it skipped in this run, for bad data (unreadable, undecodable, or killing its workers):
    #: never served; the trainer says how many when the run ends (0 from an older producer)
    skipped: int = 0
    #: the error its workers wait on object storage for ("" when none waits; at most ``MAX_STORAGE_CHARS``): the
    #: trainer then names storage, not the producer, when its batches stop coming (absent from an older producer)
    storage: str = ""
    #: seconds it waits for a silent trainer before it takes it for dead (--trainer-timeout): the trainer spaces its
    #: heartbeats by it (None from an older producer: the trainer heartbeats as often as before)
    trainer_timeout: Optional[float] = None


#: Shards a status names as cached: a status travels in one frame of at most 4 KiB (``unpack_producer_frame``).
MAX_HELD = 256
MAX_STORAGE_CHARS = 300


def _int(value: Any, what: str, low: int = 0, high: int = 2**31) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise ProtocolError(f"{what} must be an integer in [{low}, {high}), got {value!r}")
    return value


def _seconds(value: Any, what: str, low: float, high: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{what} must be seconds in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _records(value: Any, what: str) -> Records:
    if not isinstance(value, list) or len(value) > 64:
        raise ProtocolError(f"{what} must be a list of at most 64 [epoch, indices] pairs")
    out = []
    total = 0
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
            raise ProtocolError(f"{what}: each entry must be [epoch, [indices]]")
        total += len(item[1])
        if total > MAX_ROWS:
            raise ProtocolError(f"{what} lists more than {MAX_ROWS} records")
        out.append((_int(item[0], f"{what} epoch"), _indices(item[1], f"{what} index")))
    return out


def _indices(value: list, what: str) -> list[int]:
    """Record indices in [0, MAX_RECORDS), checked as one array: a credit carries a batch's worth each step. The
    list is msgpack's, bounded by the frame (``MAX_CONTROL_BYTES``) and by ``MAX_ROWS`` per message."""
    if not value:
        return []
    try:
        array = np.array(value)
    except (OverflowError, ValueError, TypeError):
        array = np.zeros(0)
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.min() < 0 or array.max() >= MAX_RECORDS:
        raise ProtocolError(f"{what} must be integers in [0, 2**40), got {value[:4]!r}...")
    return array.tolist()


def _unpack(frame: Any) -> dict:
    raw = memoryview(frame)
    if raw.nbytes > MAX_CONTROL_BYTES:
        raise ProtocolError(f"control message of {raw.nbytes} bytes is larger than {MAX_CONTROL_BYTES}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"control message is not valid msgpack ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError("control message must be a msgpack map")
    return body


def encode_hello(hello: Hello) -> bytes:
    return msgpack.packb({"t": "hello", "v": 1, "trainer": hello.trainer, "session": hello.session,
                          "credit": hello.credit, "state": hello.state.to_wire(),
                          "held": {k: [[e, list(map(int, i))] for e, i in v] for k, v in hello.held.items()},
                          "status_s": float(hello.status_s)}, use_bin_type=True)


def encode_credit(credit: Credit) -> bytes:
    return msgpack.packb({"t": "credit", "session": credit.session, "n": credit.n,
                          "consumed": [[e, list(map(int, i))] for e, i in credit.consumed]}, use_bin_type=True)


def encode_status(status: Status) -> bytes:
    return msgpack.packb({"t": "status", "stream": status.stream, "producer": status.producer,
                          "completed": status.completed, "epochs": status.epochs, "finished": status.finished,
                          "spec": [[n, d, list(shape)] for n, d, shape in status.spec], "waiting": status.waiting,
                          "session": status.session, "stranger": status.stranger, "idle": status.idle,
                          "goodbye": status.goodbye, "skipped": status.skipped, **_cache_fields(status),
                          **({"storage": status.storage[:MAX_STORAGE_CHARS]} if status.storage else {}),
                          **({"trainer_timeout": float(status.trainer_timeout)}
                             if status.trainer_timeout is not None else {})},
                         use_bin_type=True)


def encode_work(work: Work) -> bytes:
    return msgpack.packb({"t": "work", "session": work.session, "finished": work.finished,
                          "items": [[w.epoch, w.start, w.end, list(map(int, w.skip))] for w in work.items]},
                         use_bin_type=True)


def _work(body: dict) -> Work:
    items_raw = body.get("items", [])
    if not isinstance(items_raw, list) or len(items_raw) > MAX_WORK_ITEMS:
        raise ProtocolError(f"work 'items' must be a list of at most {MAX_WORK_ITEMS} [epoch, start, end, skip]")
    items = []
    for item in items_raw:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[3], list)):
            raise ProtocolError("work items must be [epoch, start, end, [offsets]]")
        start = _int(item[1], "work 'start'", 0, MAX_RECORDS)
        end = _int(item[2], "work 'end'", start + 1, min(start + MAX_SPLIT, MAX_RECORDS) + 1)
        if len(item[3]) > end - start:
            raise ProtocolError("work 'skip' lists more offsets than the split holds")
        skip = [_int(o, "work skip offset", 0, end - start) for o in item[3]]
        items.append(WorkItem(_int(item[0], "work 'epoch'"), start, end, skip))
    finished = body.get("finished", False)
    if not isinstance(finished, bool):
        raise ProtocolError("work 'finished' must be true or false")
    return Work(_int(body.get("session"), "work 'session'"), items, finished)


def encode_describe() -> bytes:
    return msgpack.packb({"t": "describe", "v": 1}, use_bin_type=True)


def encode_goodbye(goodbye: Goodbye) -> bytes:
    return msgpack.packb({"t": "goodbye", "session": goodbye.session}, use_bin_type=True)


def decode_trainer_message(frame: Any) -> Hello | Credit | Describe | Work | Goodbye:
    """A trainer's hello, credit, work, describe or goodbye; ProtocolError naming what is wrong."""
    body = _unpack(frame)
    kind = body.get("t")
    if kind == "describe":
        return Describe()
    if kind == "hello":
        if body.get("v") != 1:
            raise ProtocolError(f"hello version {body.get('v')!r}: this producer speaks exact-mode version 1; run the "
                                "same Stoker release on producers and trainers")
        trainer = body.get("trainer")
        if not is_valid_id(trainer):
            raise ProtocolError(f"hello 'trainer' must be 1-128 printable characters, got {trainer!r}")
        try:
            state = InputState.from_wire(body.get("state"))
        except ValueError as exc:
            raise ProtocolError(f"hello 'state': {exc}") from None
        held_raw = body.get("held", {})
        if not isinstance(held_raw, dict) or len(held_raw) > 4096:
            raise ProtocolError("hello 'held' must map stream keys to records")
        held = {str(k): _records(v, "hello 'held'") for k, v in held_raw.items()}
        return Hello(trainer, _int(body.get("session"), "hello 'session'"), _int(body.get("credit"), "hello 'credit'",
                                                                                  0, 1 << 16), state, held,
                     _seconds(body.get("status_s", STATUS_S), "hello 'status_s'", STATUS_S, MAX_STATUS_S))
    if kind == "credit":
        return Credit(_int(body.get("session"), "credit 'session'"), _int(body.get("n"), "credit 'n'", 0, 1 << 16),
                      _records(body.get("consumed", []), "credit 'consumed'"))
    if kind == "work":
        return _work(body)
    if kind == "goodbye":
        return Goodbye(_int(body.get("session"), "goodbye 'session'"))
    raise ProtocolError(f"unknown control message type {kind!r} (expected hello, credit, work, describe or goodbye)")


def _cache_fields(status: Status) -> dict:
    return {} if status.cache is None else {"cache": status.cache, "held": list(status.held[-MAX_HELD:])}


def decode_status(body: dict) -> Status:
    """A producer's status (``body`` is the unpacked map); ProtocolError naming what is wrong."""
    stream, producer = body.get("stream"), body.get("producer")
    if not isinstance(stream, str) or not is_valid_id(producer):
        raise ProtocolError("status needs 'stream' and 'producer' strings")
    epochs = body.get("epochs")
    if epochs is not None:
        epochs = _int(epochs, "status 'epochs'", 1)
    finished = body.get("finished")
    if not isinstance(finished, bool):
        raise ProtocolError("status 'finished' must be true or false")
    raw_spec = body.get("spec", [])
    if not isinstance(raw_spec, list) or len(raw_spec) > 64:
        raise ProtocolError("status 'spec' must be a list of at most 64 arrays")
    spec = []
    for item in raw_spec:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], str)
                and isinstance(item[2], list) and len(item[2]) <= 9):
            raise ProtocolError("status 'spec' entries must be [name, dtype, shape]")
        spec.append((item[0], item[1], [_int(d, "status spec dimension", 0, 2**31) for d in item[2]]))
    waiting = _int(body.get("waiting", 0), "status 'waiting'", 0, 2**16)
    session = _int(body.get("session", 0), "status 'session'", 0, 2**63)
    stranger = body.get("stranger", False)
    if not isinstance(stranger, bool):
        raise ProtocolError("status 'stranger' must be true or false")
    idle, goodbye = body.get("idle", False), body.get("goodbye", False)
    if not isinstance(idle, bool) or not isinstance(goodbye, bool):
        raise ProtocolError("status 'idle' and 'goodbye' must be true or false")
    cache, held = body.get("cache"), body.get("held", [])
    if cache is not None:
        cache = _int(cache, "status 'cache'", 1, MAX_RECORDS)  # shards: no more than records
    if not isinstance(held, list) or len(held) > MAX_HELD:
        raise ProtocolError(f"status 'held' must list at most {MAX_HELD} shard numbers")
    held = [_int(n, "status 'held' shard", 0, MAX_RECORDS) for n in held]
    storage = body.get("storage", "")
    if not isinstance(storage, str) or len(storage) > MAX_STORAGE_CHARS:
        raise ProtocolError(f"status 'storage' must be a string of at most {MAX_STORAGE_CHARS} characters")
    timeout = body.get("trainer_timeout")
    if timeout is not None:
        timeout = _seconds(timeout, "status 'trainer_timeout'", 0.001, 86400.0)
    return Status(stream, producer, _int(body.get("completed"), "status 'completed'"), epochs, finished, spec, waiting,
                  session, stranger, idle, goodbye, cache, held, _int(body.get("skipped", 0), "status 'skipped'", 0,
                                                                      2**63), storage, timeout)


def unpack_producer_frame(frame: Any) -> Optional[dict]:
    """The map of a producer's first frame if it is a status message, else None (a batch header)."""
    raw = memoryview(frame)
    if raw.nbytes > 4096:
        return None
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    return body if isinstance(body, dict) and body.get("t") == "status" else None
