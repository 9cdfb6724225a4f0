"""What ZMQInput and BatchStream share before receiving: arguments checked, the spec declared, a receiver chosen.

``open_core`` turns the user's arguments into a running ``ReceiveCore`` (spec resolved, not yet
delivering). The receive path (``receive=``):

- ``"auto"`` (default): direct ZMTP receive wherever it applies, that is tcp:// without
  CurveZMQ (``zmtp_receiver`` in plain mode, ``direct_dealer`` links in exact mode); libzmq
  otherwise (CurveZMQ, ipc://);
- ``"direct"`` or ``"libzmq"``: that path, or ValueError saying why it does not apply.

Every argument error is a ValueError that names the fix.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Mapping, Optional, Sequence

from stoker.protocol import DecodeLimits
from stoker.protocol.batch_codec import is_valid_id
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.curve import CurveClientKeys
from stoker.protocol.input_state import InputState

from stoker.consumer.transport.discovery import DEFAULT_REFRESH_S, AddressSource, ProducerPool, check_source
from stoker.consumer.exact.receiver import ExactReceiver
from stoker.consumer.exact.control_plane import STALL_LIMIT_S
from stoker.consumer.exact.state import parse_state
from stoker.consumer.transport.libzmq_receiver import LibzmqReceiver
from stoker.consumer.receive_core import ReceiveCore, Receiver
from stoker.consumer.exact.split_scheduler import STALL_AFTER_S
from stoker.consumer.transport.zmtp import tcp_address
from stoker.consumer.transport.zmtp_receiver import ZMTPReceiver

RECEIVE_PATHS = ("auto", "direct", "libzmq")
SpecArg = Optional[BatchSpec | Mapping[str, tuple[Any, Sequence[int]]]]


def split_addresses(addresses: AddressSource) -> list[str] | Callable[[], Sequence[str]]:
    """The producer sources as a list (or the user's discovery callable); ValueError naming the fix."""
    return check_source(addresses)


def declared_spec(spec: SpecArg, batch_size: Optional[int], image_shape: Optional[Sequence[int]],
                  exact: bool) -> Optional[BatchSpec]:
    """The declared spec with Stoker's bookkeeping arrays added (``index``, ``epoch``; exact: ``mask``), or None."""
    if spec is not None and (batch_size is not None or image_shape is not None):
        raise ValueError("give either spec or batch_size/image_shape, not both")
    if spec is not None:
        declared = spec if isinstance(spec, BatchSpec) else BatchSpec.from_dict(spec)
    elif batch_size is not None or image_shape is not None:
        declared = BatchSpec.classification(batch_size or 64, tuple(int(d) for d in (image_shape or (224, 224, 3))))
    else:
        return None
    bookkeeping = [("index", "int64"), ("epoch", "int32")] + ([("mask", "bool")] if exact else [])
    extra = {n: d for n, d in bookkeeping if n not in declared}
    if extra:
        declared = BatchSpec.from_dict({**{a.name: (a.dtype, a.shape) for a in declared.arrays},
                                        **{n: (d, [declared.batch_size]) for n, d in extra.items()}})
    return declared


def exact_identity(exact: bool, resume_state: Optional[bytes], trainer_id: Optional[str]) -> tuple[str, InputState]:
    """The trainer id and starting state: from ``resume_state``, or ``trainer_id`` (default: a random one)."""
    if (resume_state is not None or trainer_id is not None) and not exact:
        raise ValueError("resume_state and trainer_id belong to exact mode: pass exact=True (and start the "
                         "producers with --exact)")
    if trainer_id is not None and not is_valid_id(trainer_id):
        raise ValueError(f"trainer_id {trainer_id!r} must be 1-128 printable ASCII characters without spaces "
                         "(the producers refuse any other)")
    if resume_state:
        return parse_state(resume_state)
    return trainer_id or f"trainer-{secrets.token_hex(4)}", InputState()


def direct_applies(addresses: Sequence[str] | Callable[[], Sequence[str]], curve: Optional[CurveClientKeys],
                   exact: bool) -> Optional[str]:
    """None if direct receive can serve these arguments, else why not (with the fix)."""
    if curve is not None:
        return "receive='direct' speaks ZMTP without CurveZMQ: leave receive='auto' (or 'libzmq') for curve keys"
    for address in addresses if not callable(addresses) else []:  # a callable's answers are checked as they come
        try:
            tcp_address(address)
        except ValueError as exc:
            return str(exc)
    return None


def open_core(addresses: Sequence[str] | Callable[[], Sequence[str]], spec: Optional[BatchSpec], receive: str,
              recv_timeout: float, rcvhwm: int, max_message_bytes: int, curve: Optional[CurveClientKeys], exact: bool,
              trainer_id: str, state: InputState, discover_every: float = DEFAULT_REFRESH_S,
              share: tuple[int, int] = (0, 1), stall_after: Optional[float] = STALL_AFTER_S,
              stall_limit: Optional[float] = STALL_LIMIT_S) -> ReceiveCore:
    """A receive core over the chosen transport, its spec resolved (may wait up to ``recv_timeout``).

    ``addresses`` are producer sources (``discovery``): names are resolved again every ``discover_every`` s.
    ``share``: ``(rank, world)`` of an elastic pool's splits this trainer hands out (exact mode).
    ``stall_after``: seconds without progress after which a producer holding work is stuck (its pool splits go
    to others; the input logs what it waits for); ``stall_limit``: a fixed-shard producer stuck that long fails
    the input (exact mode). None turns either off."""
    for name, value in (("stall_after", stall_after), ("stall_limit", stall_limit)):
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value!r}: give seconds > 0, or None to turn it off")
    rank, world = share
    if not 0 <= rank < world:
        raise ValueError(f"share={share}: give (rank, world) with 0 <= rank < world, e.g. (0, 1) for one trainer")
    if world > 1 and not exact:
        raise ValueError("share (--share) belongs to exact mode's elastic pools: pass exact=True (--exact), with "
                         "producers running --shard auto")
    if receive not in RECEIVE_PATHS:
        raise ValueError(f"receive={receive!r}: choose 'auto' (default: direct where it applies), 'direct' or 'libzmq'")
    why_not = direct_applies(addresses, curve, exact)
    if receive == "direct" and why_not:
        raise ValueError(why_not)
    limits = DecodeLimits(max_message_bytes=max_message_bytes)
    pool = ProducerPool(addresses, discover_every)
    receiver: Receiver
    try:
        direct = receive == "direct" or (receive == "auto" and why_not is None)
        if exact:
            receiver = ExactReceiver(pool, limits, rcvhwm, trainer_id, state, curve, share, direct, stall_after,
                                     stall_limit)
        elif direct:
            receiver = ZMTPReceiver(pool, limits)
        else:
            receiver = LibzmqReceiver(pool, limits, rcvhwm, curve)
    except BaseException:
        pool.close()  # its resolving thread goes with it
        raise
    return ReceiveCore(receiver, spec, recv_timeout, stall_after)
