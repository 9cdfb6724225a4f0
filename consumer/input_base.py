"""What every framework facade shares over its receive core: opening it, exact-mode state, errors, stats.

``ZMQInput`` (TensorFlow), ``BatchStream`` (NumPy/JAX) and any other facade subclass ``InputBase``: it
opens the receive core from a ``ReceiveOptions`` and answers, the same way for all of them,
``save_state()`` / ``restore_state()`` (exact mode, through the ``ConsumedLedger``), ``exact``,
``trainer_id``, ``stats``, ``error``, ``raise_if_failed()``, ``finished``, ``consumed_epochs`` and ``serve_metrics()``
(Prometheus). A facade adds only what is its framework's: its sink, its batches, its lifecycle. No framework is
imported here.

An iterable facade (``BatchStream``, ``TorchInput``) also gives ``_take_batch`` (the next batch, not yet consumed)
and ``_padding``; the loop over them is here, once: ``_next_batch()`` for ``next()``, and ``epochs()``, one epoch
at a time (``epochs/epoch_loop.py``).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional

import numpy as np

from stoker.consumer.epochs.epoch_loop import EpochLoop, EpochSync
from stoker.consumer.epochs.held_rows import HeldBatches, Rows
from stoker.consumer.receive.errors import InputError
from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.input_setup import open_core, reading_also
from stoker.consumer.placement.local_process import LocalProducerProcess
from stoker.consumer.placement.local_producer import LocalProducer
from stoker.consumer.receive.contract import POLL_S
from stoker.consumer.receive.options import Addresses, ReceiveOptions
from stoker.consumer.receive.core import ReceiveCore
from stoker.consumer.receive.queue_sink import END, QueueSink
from stoker.consumer.receive.input_stats import InputStats
from stoker.consumer.sizing.pool_sizing import PoolSizing
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
    _epoch_loop: Optional[EpochLoop] = None  # epochs(), once called
    _sink: Optional[QueueSink] = None  # an iterable facade's queue, which the consume loop takes batches from
    _ended = False  # the sink's END was taken: a finite run's last batch is behind us
    _local_producer: Optional[LocalProducerProcess] = None  # started by _open_input; the facade's close() stops it

    def _open_input(self, options: ReceiveOptions, local_producer: Optional[LocalProducer] = None) -> None:
        """Start ``local_producer`` if given, then open the receive core reading it too (may wait up to
        ``recv_timeout`` to learn the spec); LocalProducerError if it does not start."""
        if local_producer is not None:
            self._local_producer = local_producer.start()
            options = reading_also(options, self._local_producer.address)
        self.addresses = options.addresses
        self._ledger = options.ledger
        try:
            self._core = open_core(options)
        except BaseException:
            self._stop_local_producer()
            raise
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
        stats = self._core.stats.snapshot()
        stats.sizing = self._core.sizer.latest  # how many producers this input needs (consumer/sizing)
        if self._local_producer is not None:
            stats.local_producer_deaths = self._local_producer.deaths
        return stats

    @property
    def local_producer(self) -> Optional[LocalProducerProcess]:
        """The producer this input started on its host (``local_producer=``): its ``producer_id``, ``address``,
        ``pid``, ``running``, ``deaths``; None without one."""
        return self._local_producer

    @property
    def sizing(self) -> PoolSizing:
        """How many producers this input needs, and the formula's inputs (``consumer/sizing``): demand, capacity
        per producer, the fractional need (headroom included; sum it over a job's trainers), the rounded answer."""
        return self._core.sizer.latest

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

        from stoker.consumer.receive.metrics import InputCollector

        self._metrics = MetricsServer(port, InputCollector(self), addr)
        return self._metrics.port

    def _stop_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def _stop_local_producer(self) -> None:
        """Stop the local producer, if any (SIGTERM, then SIGKILL after its ``stop_timeout``). Idempotent."""
        if self._local_producer is not None:
            self._local_producer.stop()

    # ---- batches and epochs (the iterable facades) ---------------------------------------------

    @property
    def consumed_epochs(self) -> int:
        """Exact mode: epochs whose records of this trainer's share are all consumed (handed out, or failed at
        their producer), live; an epoch boundary as ``epochs()`` sees it. ValueError in plain mode."""
        if self._ledger is None:
            raise ValueError("consumed_epochs is for exact mode: epochs are counted only when each record comes once")
        return self._ledger.consumed_epochs()

    @property
    def job_consumed_epochs(self) -> Optional[int]:
        """Epochs the whole job consumed, agreed by its ranks as the last epoch of ``epochs()`` ended (alone: this
        trainer's ``consumed_epochs`` then); None before an epoch of ``epochs()`` ended."""
        return self._epoch_loop.job_consumed_epochs if self._epoch_loop is not None else None

    def epochs(self, sync: Optional[EpochSync] = None, pad_after: float = 5.0) -> Iterator[tuple[int, Iterator[Any]]]:
        """Exact mode: ``(epoch, batches)``, one epoch at a time, as ``for epoch in range(E): for batch in loader``
        expects (``epochs/epoch_loop.py`` states the rule). ``batches`` ends once this trainer's share of
        ``epoch`` is consumed; rows of a later epoch in a batch are held back for the next. ``sync``: the ranks of
        a job (default: a ``TorchInput`` under ``torch.distributed`` uses the process group), which then end each
        epoch together after equal steps, padding with one-row batches whose ``mask`` is False (weight the loss
        by ``batch["mask"]``); ``pad_after``: seconds the ranks wait for one that holds no batch yet before
        stepping without it, for the rest of that epoch (it pads). Call it once; do not mix it with ``next()`` on the same input. ValueError in
        plain mode; the input's errors as ``next()`` raises them."""
        if self._ledger is None:
            raise ValueError(f"epochs() is for exact mode: {type(self).__name__}(..., exact=True), producers "
                             "--exact or --epochs N (plain mode has no epochs to end)")
        if self._sink is None:
            raise TypeError(self._not_iterable())
        if self._epoch_loop is not None:
            raise RuntimeError("epochs() was called already on this input: iterate that one")
        self._epoch_loop = EpochLoop(self, sync if sync is not None else self._default_sync(), HeldBatches(),
                                     POLL_S, pad_after)
        return self._epoch_loop.epochs()

    def _next_batch(self) -> Any:
        """``next()``: the next batch, consumed as it is handed out; StopIteration after a finite run's last."""
        item = self._take_batch(None)
        if item is END:
            raise StopIteration
        batch, rows = item
        if rows is not None:
            self._hand_out(rows)
        return batch

    def _open_sink(self, sink: QueueSink) -> None:
        """The iterable facade's queue: plain mode receives into it from now on; exact mode from the first batch
        taken (``_start_receiving``), so a state may be restored first."""
        self._sink = sink
        self._core.sizer.demand.time_waits()  # an iterable facade knows when its trainer waits: _take_from_sink
        if self._ledger is None:
            self._core.start(sink)

    def _start_receiving(self) -> None:
        """Exact mode, the first batch taken: the ledger says hello on every connection, the core starts."""
        if self._ledger is not None and not self._ledger.started:
            self._ledger.activate()
            self._core.start(self._sink)

    def _take_batch(self, timeout: Optional[float]) -> Any:
        """The facade's next batch as ``(batch, Rows or None)`` (padding rows cut off; ``Rows`` in exact mode), not
        yet consumed; ``END`` after a finite run's last; None if nothing came within ``timeout`` (None: wait).
        Raises the input's error once what arrived before it is taken. A facade that stages batches ahead
        (``TorchInput``) overrides it over ``_take_from_sink``."""
        if self._sink is None:
            raise TypeError(self._not_iterable())
        if self._ended:
            return END
        self._start_receiving()
        return self._take_from_sink(float("inf") if timeout is None else timeout)

    def _not_iterable(self) -> str:
        name = type(self).__name__
        return (f"{name} is not iterated batch by batch (its framework takes the batches: get(), as_dataset()): "
                f"watch {name}.consumed_epochs for where an epoch ends, or take epochs() from a BatchStream or "
                "TorchInput")

    def _take_from_sink(self, wait: float) -> Any:
        """The sink's next batch, named (``_named``); ``END`` (then ``_ended``), or None if none came within ``wait``
        seconds (inf: until one comes). The input's error once the sink is empty."""
        assert self._sink is not None
        deadline = time.monotonic() + wait
        demand = self._core.sizer.demand
        demand.begin_wait()  # the trainer's wait for input (consumer/sizing), booked as it goes
        try:
            while True:
                item = self._sink.take(max(0.0, min(POLL_S, deadline - time.monotonic())))
                if item is END:
                    self._ended = True
                    return END
                if item is not None:
                    return self._named(item)
                error = self._core.error
                if error is not None and self._sink.size() == 0:
                    raise error
                if time.monotonic() >= deadline:
                    return None
        finally:
            demand.end_wait()

    def _named(self, arrays: list[Any]) -> tuple[dict[str, Any], Optional[Rows]]:
        """The batch by name and, exact mode, its records (to count consumed when handed out); padding rows (a
        finite run's last batch) are cut off, in a copy (``_kept``). Exact mode's ``stoker_source`` column (last)
        is left out of the batch."""
        batch = dict(zip(self.spec.names, arrays))
        if self._ledger is None:
            return batch, None
        mask = self._host(batch["mask"])
        rows = Rows(self._ledger.source_of(arrays), self._host(batch["epoch"])[mask],
                    self._host(batch["index"])[mask])
        if not mask.all():
            batch = self._kept(batch, mask)
        return batch, rows

    @staticmethod
    def _host(array: Any) -> np.ndarray:
        """A batch array as NumPy, no copy (a facade of another framework's host arrays overrides it)."""
        return np.asarray(array)

    def _kept(self, batch: dict[str, Any], mask: np.ndarray) -> dict[str, Any]:
        """The batch's rows where ``mask`` is True, in new arrays of the facade's framework."""
        return {name: np.ascontiguousarray(a[mask]) for name, a in batch.items()}

    def _hand_out(self, rows: Rows) -> None:
        """Rows go to the caller: consumed now."""
        assert self._ledger is not None
        self._ledger.consumed(rows.source, rows.epochs, rows.indices, rows.mask)

    def _waiting(self) -> None:
        """The caller waits for data; nothing to do unless the facade defers consumption."""

    def _padding(self, epoch: int) -> Any:
        raise TypeError(f"{type(self).__name__} has no padding batches")

    def _default_sync(self) -> Optional[EpochSync]:
        return None

