"""What every facade does before receiving: its keyword arguments into ``ReceiveOptions``, then a receive core.

``receive_options(...)`` checks a facade's arguments and builds the one options object (exact mode: with
its ``ConsumedLedger``, from ``resume_state`` or ``trainer_id``); ``open_core(options)`` picks the
receiver the options chose and returns a running ``ReceiveCore`` (spec resolved, not yet delivering).
Every argument error is a ValueError that names the fix.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.receiver import ExactReceiver
from stoker.consumer.receive.contract import Receiver
from stoker.consumer.receive.core import ReceiveCore
from stoker.consumer.receive.options import AddressSource, ReceiveOptions, SpecArg, check_source, declared_spec
from stoker.consumer.transport.discovery import ProducerPool
from stoker.consumer.transport.libzmq_receiver import LibzmqReceiver
from stoker.consumer.transport.zmtp_receiver import ZMTPReceiver


def receive_options(addresses: AddressSource, *, spec: SpecArg = None, batch_size: Optional[int] = None,
                    image_shape: Optional[Sequence[int]] = None, exact: bool = False,
                    resume_state: Optional[bytes] = None, trainer_id: Optional[str] = None,
                    **options: Any) -> ReceiveOptions:
    """The options from a facade's keyword arguments (the rest by name, as the fields); ValueError naming the fix."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: give the producers' batch size, >= 1")
    ledger = ConsumedLedger.start(resume_state, trainer_id, options.get("share", (0, 1))) if exact else None
    if ledger is None and (resume_state is not None or trainer_id is not None):
        raise ValueError("resume_state and trainer_id belong to exact mode: pass exact=True (and start the "
                         "producers with --exact)")
    return ReceiveOptions(check_source(addresses), declared_spec(spec, batch_size, image_shape, exact),
                          ledger=ledger, **options)


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
