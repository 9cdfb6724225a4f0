"""What every facade does before receiving: its shared keyword arguments as one ``InputOptions``, then a receive core.

``InputOptions`` holds the keyword arguments every facade takes alike (``BatchStream``'s order and defaults;
a facade's own signature keeps its defaults, ``ZMQInput``'s ``queue_capacity=50`` say) and checks the
ones the floor does not; ``.receive_options()`` builds the one checked ``ReceiveOptions`` (exact mode: with
its ``ConsumedLedger``, from ``resume_state`` or ``trainer_id``). A facade whose signature lists them
builds it with ``InputOptions.from_arguments(locals())``; a new facade may take ``**kw`` and write
``InputOptions(addresses, **kw)``. ``open_core(options)`` picks the receiver the options chose and returns a
running ``ReceiveCore`` (spec resolved, not yet delivering). Every argument error is a ValueError that names
the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional, Sequence

from stoker.protocol import DEFAULT_MAX_MESSAGE_BYTES
from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.pool.partition import partition
from stoker.consumer.exact.receiver import ExactReceiver
from stoker.consumer.placement.local_producer import LocalProducer
from stoker.consumer.receive.contract import Receiver
from stoker.consumer.receive.core import ReceiveCore
from stoker.consumer.receive.options import (DEFAULT_REFRESH_S, STALL_AFTER_S, STALL_LIMIT_S, Addresses,
                                             AddressSource, ReceiveOptions, SpecArg, check_source, declared_spec)
from stoker.consumer.transport.discovery import ProducerPool
from stoker.consumer.transport.libzmq_receiver import LibzmqReceiver
from stoker.consumer.transport.zmtp_receiver import ZMTPReceiver


@dataclass(frozen=True)
class InputOptions:
    """The keyword arguments every facade shares, as its users write them (``BatchStream``'s doc says each one).

    ``queue_capacity`` is the facade's sink's, in batches; ``local_producer`` the producer a facade starts on
    this host (``consumer/placement/``; addresses may then be empty); the rest go to the receive core. Constructing it
    checks ``batch_size`` and ``queue_capacity``; ``receive_options()`` checks the rest (ValueError naming the
    fix)."""

    addresses: AddressSource
    batch_size: Optional[int] = None
    image_shape: Optional[Sequence[int]] = None
    spec: SpecArg = None
    queue_capacity: int = 8
    recv_timeout: float = 60.0
    rcvhwm: int = 4
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    curve: Optional[CurveClientKeys] = None
    exact: bool = False
    resume_state: Optional[bytes] = None
    trainer_id: Optional[str] = None
    receive: str = "auto"
    discover_every: float = DEFAULT_REFRESH_S
    share: tuple[int, int] = (0, 1)
    stall_after: Optional[float] = STALL_AFTER_S
    stall_limit: Optional[float] = STALL_LIMIT_S
    producers_per_trainer: Optional[int] = None
    local_producer: Optional[LocalProducer] = None

    def __post_init__(self) -> None:
        if self.queue_capacity < 1:
            raise ValueError(f"queue_capacity={self.queue_capacity}: give batches >= 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: give the producers' batch size, >= 1")

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], **overrides: Any) -> "InputOptions":
        """The options among a facade's arguments (its ``locals()`` as ``__init__`` begins), by name; a facade's
        own arguments are left out, ``overrides`` replace what the facade resolved itself (``TorchInput``'s
        share). TypeError naming the shared arguments a facade's signature lacks."""
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in arguments and name not in overrides]
        if missing:
            raise TypeError(f"a facade takes every shared argument of InputOptions; missing: {missing}")
        return cls(**{name: overrides[name] if name in overrides else arguments[name] for name in names})

    def receive_options(self) -> ReceiveOptions:
        """The one checked ``ReceiveOptions`` (exact mode: a new ``ConsumedLedger``, so build it once per input);
        ValueError naming the fix."""
        ledger = ConsumedLedger.start(self.resume_state, self.trainer_id, self.share) if self.exact else None
        if ledger is None and (self.resume_state is not None or self.trainer_id is not None):
            raise ValueError("resume_state and trainer_id belong to exact mode: pass exact=True (and start the "
                             "producers with --exact)")
        if self.local_producer is not None:
            self.local_producer.check_mode(self.exact)
        return ReceiveOptions(self._addresses(),
                              declared_spec(self.spec, self.batch_size, self.image_shape, self.exact),
                              receive=self.receive, recv_timeout=self.recv_timeout, rcvhwm=self.rcvhwm,
                              max_message_bytes=self.max_message_bytes, curve=self.curve, ledger=ledger,
                              discover_every=self.discover_every, share=self.share, stall_after=self.stall_after,
                              stall_limit=self.stall_limit)


    def _addresses(self) -> Addresses:
        """The addresses this trainer reads: all given, or its partition of them (``producers_per_trainer``); none
        if a local producer is all it reads (its address is added once it runs: ``reading_also``)."""
        if self.local_producer is not None and _none_given(self.addresses):
            return []
        addresses = check_source(self.addresses)
        if self.producers_per_trainer is None:
            return addresses
        if callable(addresses):
            raise ValueError("producers_per_trainer partitions a list of addresses, the same list for every trainer; "
                             "a discovery callable's list changes as producers come and go: give the list")
        return partition(addresses, *self.share, per_trainer=self.producers_per_trainer)


def _none_given(source: AddressSource) -> bool:
    """No address given: an empty list or string (a local producer may be all a trainer reads)."""
    if callable(source):
        return False
    return all(isinstance(a, str) and not a.strip() for a in (source.split(",") if isinstance(source, str) else source))


def reading_also(options: ReceiveOptions, address: str) -> ReceiveOptions:
    """``options`` reading ``address`` too (a local producer's, after any partition: each trainer reads its own)."""
    source = options.addresses
    addresses: Addresses = (lambda: [*source(), address]) if callable(source) else [*source, address]
    return replace(options, addresses=addresses)


def open_core(options: ReceiveOptions) -> ReceiveCore:
    """A receive core over the path ``options`` chose, its spec resolved (may wait up to ``recv_timeout``)."""
    pool = ProducerPool(options.addresses, options.discover_every)
    receiver: Receiver
    try:
        if options.ledger is not None:
            receiver = ExactReceiver(pool, options)
        elif options.direct:
            receiver = ZMTPReceiver(pool, options)
        else:
            receiver = LibzmqReceiver(pool, options)
    except BaseException:
        pool.close()  # its resolving thread goes with it
        raise
    return ReceiveCore(receiver, options)
