"""What every framework facade shares over its receive core: opening it, exact-mode state, errors, stats.

``ZMQInput`` (TensorFlow), ``BatchStream`` (NumPy/JAX) and any other facade subclass ``InputBase``: it
opens the receive core from a ``ReceiveOptions`` and answers, the same way for all of them,
``save_state()`` / ``restore_state()`` (exact mode, through the ``ConsumedLedger``), ``exact``,
``trainer_id``, ``stats``, ``error``, ``raise_if_failed()``, ``finished`` and ``serve_metrics()`` (Prometheus). A facade adds only what is
its framework's: its sink, its batches, its lifecycle. No framework is imported here.
"""

from __future__ import annotations

from typing import Any, Optional

from stoker.consumer.errors import InputError
from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.input_setup import open_core
from stoker.consumer.receive_options import Addresses, ReceiveOptions
from stoker.consumer.receive_core import ReceiveCore
from stoker.consumer.receive_stats import InputStats
from stoker.protocol.batch_spec import BatchSpec


class InputBase:
    """The shared part of the facades; see the module doc. ``_open_input`` first, in the constructor."""

    addresses: Addresses
    spec: BatchSpec
    batch_size: int
    receive: str  #: the receive path chosen: "direct" or "libzmq"
    _core: ReceiveCore
    _ledger: Optional[ConsumedLedger]
    _metrics: Any = None  # the Prometheus server, once serve_metrics() started it; the facade's close() stops it

    def _open_input(self, options: ReceiveOptions) -> None:
        """Open the receive core (may wait up to ``recv_timeout`` to learn the spec)."""
        self.addresses = options.addresses
        self._ledger = options.ledger
        self._core = open_core(options)
        self.spec = self._core.spec
        self.batch_size = self.spec.batch_size
        self.receive = "direct" if options.direct else "libzmq"

    @property
    def exact(self) -> bool:
        """Exact epochs: each record once per epoch, with a state to checkpoint."""
        return self._ledger is not None

    @property
    def trainer_id(self) -> Optional[str]:
        """Exact mode: the id this trainer goes by with the producers (it comes with a restored state)."""
        return self._ledger.trainer_id if self._ledger is not None else None

    def save_state(self) -> bytes:
        """Exact mode: this trainer's id and every record its steps consumed, as bytes for a checkpoint."""
        if self._ledger is None:
            raise ValueError(f"save_state() is for exact mode: {type(self).__name__}(..., exact=True) with producers "
                             "--exact")
        return self._ledger.save_state()

    def restore_state(self, data: bytes) -> None:
        """Exact mode: continue from ``save_state()`` bytes, before the first batch is taken.

        ValueError for bytes that are not a saved state; RuntimeError once batches may be queued."""
        if self._ledger is None:
            raise ValueError(f"restore_state() is for exact mode: {type(self).__name__}(..., exact=True)")
        self._ledger.restore_state(data)

    @property
    def stats(self) -> InputStats:
        """Counters so far: batches, bytes, rejects, occupancy, per producer, exact mode's control plane."""
        return self._core.stats.snapshot()

    @property
    def error(self) -> Optional[InputError]:
        """Why the input failed (timeout, misconfiguration), InputClosedError after ``close()``, or None."""
        return self._core.error

    def raise_if_failed(self) -> None:
        """Raise the input's error (timeout, closed) if it has one."""
        if self._core.error is not None:
            raise self._core.error

    @property
    def finished(self) -> bool:
        """Exact mode, a finite run: every producer finished its epochs (the input ends after the last batch)."""
        return self._core.finished

    def serve_metrics(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve Prometheus metrics on ``http://addr:port/metrics`` until close(); returns the port (0: any free)."""
        from stoker.protocol.metrics_server import MetricsServer

        from stoker.consumer.input_metrics import InputCollector

        self._metrics = MetricsServer(port, InputCollector(self), addr)
        return self._metrics.port

    def _stop_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
