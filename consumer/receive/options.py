"""The receive options every facade shares, as one checked object, and the address checks they need.

``ReceiveOptions`` holds what ``ZMQInput``, ``BatchStream`` and any other facade pass to their receive
core: producer addresses, the declared spec, timeouts, limits, curve keys, exact mode (its ledger),
discovery, share, stall bounds and the receive path. ``open_core`` and every receiver take it; a
facade keeps its keyword arguments for users and builds it (``input_setup.InputOptions``), adding
only what is its framework's. The receive path (``receive=``):

- ``"auto"`` (default): direct ZMTP receive wherever it applies, that is tcp:// and ipc:// (a producer on this
  host, a Unix socket) without CurveZMQ; libzmq otherwise (CurveZMQ);
- ``"direct"`` or ``"libzmq"``: that path, or ValueError saying why it does not apply.

Imports nothing of the consumer's wings: they import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union
from urllib.parse import urlsplit

from stoker.protocol import DEFAULT_MAX_MESSAGE_BYTES, DecodeLimits
from stoker.protocol.batch_spec import BatchSpec, bookkeeping_arrays
from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.receive.stream_address import stream_address

if TYPE_CHECKING:
    from stoker.consumer.exact.ledger import ConsumedLedger

RECEIVE_PATHS = ("auto", "direct", "libzmq")
#: seconds between re-resolving producer names
DEFAULT_REFRESH_S = 5.0
#: seconds without progress after which a producer holding work is stuck (``stall_after``)
STALL_AFTER_S = 10.0
#: seconds a fixed-shard producer may stay stuck before it fails the input (``stall_limit``, exact mode)
STALL_LIMIT_S = 300.0
SpecArg = Optional[Union[BatchSpec, Mapping[str, tuple[Any, Sequence[int]]]]]
AddressSource = Union[Sequence[str], str, Callable[[], Sequence[str]]]
Addresses = Union[list[str], Callable[[], Sequence[str]]]


def check_source(source: AddressSource) -> Union[list[str], Callable[[], Sequence[str]]]:
    """The source as a list of addresses or a callable; ValueError naming the fix for an empty one."""
    if callable(source):
        return source
    if isinstance(source, str):
        source = [a.strip() for a in source.split(",") if a.strip()]
    addresses = list(source)
    if not addresses:
        raise ValueError("give at least one producer address, e.g. tcp://datahost:5555 (or a name that resolves to "
                         "every producer, such as a Kubernetes headless Service: tcp://stoker-producer.NS.svc:5555)")
    for address in addresses:
        if not isinstance(address, str):
            raise ValueError(f"producer address {address!r} must be a string like tcp://host:port")
        if "://" not in address:
            raise ValueError(f"producer address {address!r} has no scheme: write tcp://{address} (addresses look "
                             "like tcp://host:port)")
        parts = urlsplit(address)
        if parts.scheme == "tcp":
            try:
                port = parts.port
            except ValueError:
                port = None
            if not parts.hostname or port is None:
                raise ValueError(f"producer address {address!r} needs a host and a port, e.g. tcp://datahost:5555")
    return addresses


@dataclass(frozen=True)
class ReceiveOptions:
    """The receive options shared by every facade, checked; see the module doc and ``ZMQInput`` for each one.

    ``spec`` is the declared spec with Stoker's bookkeeping arrays added, or None to learn it. ``ledger`` is
    exact mode's state owner (trainer id, consumed records), None in plain mode: exact mode is decided here,
    once. Facades build it with ``InputOptions(...).receive_options()`` from their keyword arguments; every field
    is checked here (ValueError naming the fix).
    """

    addresses: Addresses
    spec: Optional[BatchSpec] = None
    receive: str = "auto"
    recv_timeout: float = 60.0
    rcvhwm: int = 4
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    curve: Optional[CurveClientKeys] = None
    ledger: Optional["ConsumedLedger"] = None
    discover_every: float = DEFAULT_REFRESH_S
    share: tuple[int, int] = (0, 1)
    stall_after: Optional[float] = STALL_AFTER_S
    stall_limit: Optional[float] = STALL_LIMIT_S

    def __post_init__(self) -> None:
        if not self.recv_timeout > 0:
            raise ValueError(f"recv_timeout={self.recv_timeout!r}: give seconds > 0")
        if self.rcvhwm < 0:
            raise ValueError(f"rcvhwm={self.rcvhwm!r}: give batches >= 0 (default 4; 0: libzmq's no limit)")
        for name in ("stall_after", "stall_limit"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r}: give seconds > 0, or None to turn it off")
        rank, world = self.share
        if not 0 <= rank < world:
            raise ValueError(f"share={self.share}: give (rank, world) with 0 <= rank < world, e.g. (0, 1) for one "
                             "trainer")
        if world > 1 and not self.exact:
            raise ValueError("share (--share) belongs to exact mode's elastic pools: pass exact=True (--exact), with "
                             "producers running --shard auto")
        if self.receive not in RECEIVE_PATHS:
            raise ValueError(f"receive={self.receive!r}: choose 'auto' (default: direct where it applies), 'direct' "
                             "or 'libzmq'")
        why_not = self.why_not_direct()
        if self.receive == "direct" and why_not:
            raise ValueError(why_not)

    @property
    def exact(self) -> bool:
        return self.ledger is not None

    @property
    def limits(self) -> DecodeLimits:
        return DecodeLimits(max_message_bytes=self.max_message_bytes)

    @property
    def direct(self) -> bool:
        """Whether batches arrive by direct ZMTP receive (else libzmq): the path ``receive`` chose."""
        return self.receive == "direct" or (self.receive == "auto" and self.why_not_direct() is None)

    def why_not_direct(self) -> Optional[str]:
        """None if direct receive can serve these options, else why not (with the fix)."""
        if self.curve is not None:
            return "receive='direct' speaks ZMTP without CurveZMQ: leave receive='auto' (or 'libzmq') for curve keys"
        for address in self.addresses if not callable(self.addresses) else []:  # a callable's answers: as they come
            try:
                stream_address(address)
            except ValueError as exc:
                return str(exc)
        return None


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
    bookkeeping = bookkeeping_arrays(exact)
    extra = {n: d for n, d in bookkeeping if n not in declared}
    if extra:
        declared = BatchSpec.from_dict({**{a.name: (a.dtype, a.shape) for a in declared.arrays},
                                        **{n: (d, [declared.batch_size]) for n, d in extra.items()}})
    return declared
