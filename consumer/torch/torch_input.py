"""TorchInput: batches from Stoker producers as dicts of ``torch.Tensor``, for any PyTorch training loop.

    producers --> receive core --> PinnedSink --> DevicePrefetch --> your step
                  (as BatchStream)  (tensors, pinned)  (side CUDA stream, prefetch ahead)

The receive core under ``ZMQInput`` and ``BatchStream`` (direct ZMTP over tcp:// and ipc:// by default, libzmq
for CurveZMQ, exact mode with its state, discovery and elastic pools, a declared or learned spec), delivering into
torch tensors: each array is received straight into a tensor's memory, pinned when CUDA is available
(``pinned_sink.py``), and ``device="cuda:N"`` copies batches to the GPU ``prefetch`` batches ahead on a side
stream, the step's stream waiting on an event (``device_prefetch.py``). TensorFlow is never imported. ::

    import torch
    from stoker.consumer import TorchInput

    with TorchInput(["tcp://datahost:5555"], device="cuda:0", channels_last=True,
                    dtypes={"images": torch.float16}) as inp:
        for step, batch in zip(range(1000), inp):
            images, labels = batch["images"], batch["labels"]   # on cuda:0: float16 [B, 3, H, W], int32 [B]

Ownership (as ``torch.utils.data.DataLoader``): each batch's tensors belong to the caller; Stoker never
reads or writes them again. On the CPU they are the very tensors the bytes were received into.

Exact mode (``exact=True``): a batch's records count as consumed when ``next()`` returns it (batches staged
ahead are held, not consumed). ``state_dict()`` / ``load_state_dict()`` (before the first ``next()``) carry
``save_state()``'s bytes, for ``torch.save`` or ``torch.distributed.checkpoint`` (``checkpoint_state.py``).
Under ``torch.distributed`` (torchrun, DDP) an exact input takes ``share=(rank, world_size)`` from the
initialised process group, so each rank trains on its own splits of an elastic pool, and ``state_dict()``
gathers every rank's state into one *job state*, the same on every rank: ``dcp.save({"input": inp, ...})``
keeps it once, and a job restarted on any number of ranks continues from it (``dcp.load``), each record of
the open epoch once across the new ranks. ``load_state_dict([...])`` merges the states of a job's ranks
saved one by one (``torch.save`` per rank).

One epoch at a time: ``for epoch, batches in inp.epochs()`` (``InputBase.epochs``); under ``torch.distributed``
the ranks end each epoch together after equal steps, a rank whose share ran out stepping on one-row padding
batches (``mask`` False): weight the loss by ``batch["mask"]`` (``epochs/epoch_loop.py``, ``epoch_sync.py``).

Errors as ``BatchStream``'s: the input's error (InputTimeoutError, InputError) is raised by ``next()`` once
the batches that arrived before it are handed out; after ``close()``, ``next()`` raises InputClosedError.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from stoker.protocol import DEFAULT_MAX_MESSAGE_BYTES
from stoker.protocol.curve import CurveClientKeys

from stoker.consumer.receive.errors import InputClosedError
from stoker.consumer.receive.queue_sink import END
from stoker.consumer.marked_consumption import MarkedConsumption
from stoker.consumer.epochs.epoch_loop import EpochSync
from stoker.consumer.epochs.held_rows import Rows, padding_arrays
from stoker.consumer.input_base import InputBase
from stoker.consumer.input_setup import InputOptions
from stoker.consumer.placement.local_producer import LocalProducer
from stoker.consumer.receive.options import SpecArg
from stoker.consumer.exact.state import merge_states
from stoker.consumer.torch.checkpoint_state import state_bytes, state_dict_of
from stoker.consumer.torch.device_prefetch import Batch, DevicePrefetch, convert
from stoker.consumer.torch.pinned_sink import PinnedSink


def training_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` with an index; ValueError naming the fix for one this machine lacks."""
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device={str(device)!r}: TorchInput stages batches on 'cpu' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but torch.cuda.is_available() is False here: pass device='cpu' "
                         "or run where PyTorch sees a GPU")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def default_share(share: Optional[tuple[int, int]], exact: bool) -> tuple[int, int]:
    """``share`` if given; else, in exact mode under an initialised ``torch.distributed``, ``(rank, world_size)``;
    else ``(0, 1)`` (plain mode needs no share: PUSH hands each batch to one trainer)."""
    if share is not None:
        return (int(share[0]), int(share[1]))
    if _distributed(exact):
        return (dist.get_rank(), dist.get_world_size())
    return (0, 1)


def _distributed(exact: bool) -> bool:
    return exact and dist.is_available() and dist.is_initialized()


class TorchInput(InputBase):
    """An iterator of ``{name: torch.Tensor}`` batches from Stoker producers; see the module doc.

    Args (``BatchStream``'s, defaults included): ``addresses``; ``batch_size``/``image_shape`` or ``spec``
    (default: learned from the first batch); ``queue_capacity`` (8 batches); ``recv_timeout`` (60 s);
    ``rcvhwm`` (4); ``max_message_bytes`` (512 MiB); ``curve``; ``exact``, ``resume_state``, ``trainer_id``;
    ``receive`` (``"auto"``); ``discover_every`` (5 s); ``share`` (``(rank, world)``; default None: from
    ``torch.distributed`` in exact mode when it is initialised, else ``(0, 1)``); ``stall_after`` (10 s),
    ``stall_limit`` (300 s), ``producers_per_trainer`` (None: every address; ``k``: this rank's ``k`` by its share,
    a partitioned pool), ``local_producer`` (None: a ``LocalProducer`` started on this host, as ``BatchStream``'s).
    PyTorch's own, by keyword:

    - ``device``: ``"cpu"`` (default) or ``"cuda:N"``, where batches are handed out.
    - ``prefetch``: batches staged on the device ahead of the step (default 2); their copies overlap it.
    - ``channels_last``: 4-D arrays (images, sent NHWC) become NCHW tensors in ``torch.channels_last``
      memory format, a view of the same bytes (default False: as sent).
    - ``dtypes``: ``{name: torch.dtype}`` conversions done on the device after the copy, e.g.
      ``{"images": torch.float16}`` (values unchanged: 0-255 stays 0-255).
    - ``pin_memory``: receive into pinned host memory (default None: when ``torch.cuda.is_available()``).
    - ``consumed_when``: exact mode, when a batch's records count as consumed: ``"next"`` (default) as
      ``next()`` returns it, or ``"marked"``: as ``mark_consumed()`` is called, once per batch in the order they
      were handed out. For loops that fetch ahead of the step (PyTorch Lightning's fit loop takes the next batch
      before the step ends, so a checkpoint taken then would count a batch never trained on): mark each batch as
      its step starts (``on_train_batch_start``). A batch handed out and not marked also counts once ``next()``
      has to wait for the next one (the loop holds it and is about to train it; the pool's epoch window and a
      finite run's end may be waiting for exactly its records); its ``mark_consumed()`` then marks nothing new.

    Memory: at most ``max_batches_held()`` batches.
    """

    def __init__(self, addresses: Sequence[str] | str, batch_size: Optional[int] = None,
                 image_shape: Optional[Sequence[int]] = None, spec: SpecArg = None, queue_capacity: int = 8,
                 recv_timeout: float = 60.0, rcvhwm: int = 4, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 curve: Optional[CurveClientKeys] = None, exact: bool = False, resume_state: Optional[bytes] = None,
                 trainer_id: Optional[str] = None, receive: str = "auto", discover_every: float = 5.0,
                 share: Optional[tuple[int, int]] = None, stall_after: Optional[float] = 10.0,
                 stall_limit: Optional[float] = 300.0, producers_per_trainer: Optional[int] = None,
                 local_producer: Optional[LocalProducer] = None, *,
                 device: str | torch.device = "cpu", prefetch: int = 2,
                 channels_last: bool = False, dtypes: Optional[Mapping[str, torch.dtype]] = None,
                 pin_memory: Optional[bool] = None, consumed_when: str = "next") -> None:
        self.share = default_share(share, exact)
        shared = InputOptions.from_arguments(locals(), share=self.share)
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch}: give batches >= 1 (default 2)")
        if consumed_when not in ("next", "marked"):
            raise ValueError(f"consumed_when={consumed_when!r}: choose 'next' (default) or 'marked' (mark_consumed())")
        if consumed_when == "marked" and not exact:
            raise ValueError("consumed_when='marked' belongs to exact mode: pass exact=True")
        for name, dtype in (dtypes or {}).items():
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtypes[{name!r}] = {dtype!r}: give a torch.dtype, e.g. torch.float16")
        self.device = training_device(device)
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True, but torch.cuda.is_available() is False here: pinned memory needs CUDA "
                             "(leave pin_memory=None: pinned exactly where CUDA is available)")
        self.queue_capacity, self.prefetch = queue_capacity, prefetch
        #: state_dict() gathers every rank's state into the job state (share from torch.distributed, world > 1)
        self.gathers_job_state = share is None and _distributed(exact) and self.share[1] > 1
        self._open_input(shared.receive_options(), local_producer)
        self._marks = MarkedConsumption(self._ledger) if consumed_when == "marked" and self._ledger else None
        try:
            unknown = sorted(set(dtypes or {}) - set(self.spec.names))
            if unknown:
                raise ValueError(f"dtypes names {unknown}, but the batches carry {list(self.spec.names)}")
            sink = PinnedSink(queue_capacity, torch.cuda.is_available() if pin_memory is None else pin_memory)
            self._staging = DevicePrefetch(self.device, prefetch, channels_last, dtypes)
        except BaseException:
            self._core.close()
            raise
        self._lock = threading.Lock()  # one next() at a time; close() waits for it (bounded: it polls)
        self._closed = False
        self._open_sink(sink)

    # ---- the batches ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self._next_batch()

    def _take_batch(self, timeout: Optional[float]) -> Any:
        with self._lock:
            if self._closed:
                self.raise_if_failed()
                raise InputClosedError("this TorchInput was closed")
            self._start_receiving()
            if self._marks is not None:
                self._marks.check_room()
            if not len(self._staging):
                if self._ended or (not self._stage(0.0) and self._ended):
                    return END
                if not len(self._staging):
                    self._count_outstanding()  # about to wait: what the loop holds is about to be trained
                    if not self._stage(float("inf") if timeout is None else timeout):
                        return END if self._ended else None
            tensors, rows = self._staging.pop()
            while not self._ended and not self._staging.full() and self._stage(0.0):
                pass  # stage what the queue holds already: its copies overlap the caller's step
            return tensors, rows

    def _hand_out(self, rows: Rows) -> None:
        if self._marks is not None:
            self._marks.handed_out(rows)
        else:
            super()._hand_out(rows)

    def _waiting(self) -> None:
        self._count_outstanding()

    def _padding(self, epoch: int) -> Batch:
        if self._marks is not None:  # a step on it calls mark_consumed() too: that mark consumes nothing
            self._marks.handed_out(Rows(-1, np.empty(0, np.int32), np.empty(0, np.int64)))
        host = {name: torch.from_numpy(a) for name, a in padding_arrays(self.spec, epoch).items()}
        return convert(host, self.device, self._staging.channels_last, self._staging.dtypes, False)

    def _default_sync(self) -> Optional[EpochSync]:
        """Under ``torch.distributed`` with the share taken from it: the process group (``epoch_sync.py``)."""
        if not self.gathers_job_state:
            return None
        from stoker.consumer.torch.epoch_sync import ProcessGroupSync

        return ProcessGroupSync(self.device)

    def mark_consumed(self) -> None:
        """``consumed_when="marked"``: the oldest batch handed out and not yet marked is consumed now (its step
        starts). RuntimeError if every batch handed out is marked already, or in another mode."""
        if self._marks is None:
            raise RuntimeError("mark_consumed() is for TorchInput(..., exact=True, consumed_when='marked'); by "
                               "default a batch is consumed as next() returns it")
        assert self._marks is not None
        self._marks.mark()

    def _count_outstanding(self) -> None:
        """``consumed_when="marked"``: batches handed out and not marked count as consumed now (see the class doc)."""
        if self._marks is not None:
            self._marks.count_outstanding()

    def _stage(self, wait: float) -> bool:
        """Stage the queue's next batch; whether one was. Waits up to ``wait`` seconds (inf: until one comes);
        False at the end of a finite run (``_ended``) or when none came; the input's error once the queue is empty."""
        item = self._take_from_sink(wait)
        if item is END or item is None:
            return False
        self._staging.stage(*item)
        return True

    @staticmethod
    def _host(array: torch.Tensor) -> np.ndarray:
        return array.numpy()

    def _kept(self, batch: Batch, mask: np.ndarray) -> Batch:
        keep = batch["mask"]
        return {name: tensor[keep] for name, tensor in batch.items()}

    # ---- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Exact mode: ``{"stoker_input_state": <bytes>, "version": 1}``, for ``torch.save`` or
        ``torch.distributed.checkpoint`` (this input is a ``Stateful``). ValueError in plain mode.

        Under ``torch.distributed`` with the share taken from it (``gathers_job_state``) the bytes are the *job
        state*: every rank's state, gathered and merged, the same on every rank, so ``dcp.save({"input": inp})``
        under one key holds the whole job's input and a job of any size resumes from it. That call is then
        collective, as ``dcp.save`` is: every rank makes it (``if rank == 0: torch.save(inp.state_dict())``
        waits for the others for ever; call it on every rank and save on one). Otherwise, ``save_state()``'s
        bytes (an input given ``share=`` explicitly: each rank's own, merged with ``load_state_dict(list)``)."""
        if self.gathers_job_state:
            from stoker.consumer.torch.job_state import job_state_of

            return state_dict_of(job_state_of(self.save_state(), self.device))
        return state_dict_of(self.save_state())

    def load_state_dict(self, state_dict: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> None:
        """Exact mode: continue from a ``state_dict()`` (a job state included), or from a list of the
        ``state_dict()``s of every rank of one job (merged: ``merge_states``), before the first ``next()``; this
        rank takes its share of what the job left, whatever the job's size was. ValueError naming what is wrong
        with the dicts or their bytes, RuntimeError once batches may be queued."""
        if isinstance(state_dict, Sequence) and not isinstance(state_dict, (str, bytes)):
            self.restore_state(merge_states([state_bytes(d) for d in state_dict]))
        else:
            self.restore_state(state_bytes(state_dict))

    # ---- what a user watches ----------------------------------------------------------------------

    @property
    def pinned(self) -> bool:
        """Whether batches are received into pinned (page-locked) host memory."""
        return self._sink.pin

    def queue_occupancy(self) -> float:
        """Fraction of the receive queue in use right now; near 0 means the step waits for input."""
        return self._sink.size() / self._sink.capacity

    def max_batches_held(self) -> int:
        """The most batches this input holds at once: the queue, ``prefetch`` staged, the caller's, and per producer
        what its connection may hold. Host memory on CUDA adds up to ``prefetch`` batches whose copies run."""
        per_producer = self._core.receiver.held_per_producer
        return self.queue_capacity + self.prefetch + 1 + per_producer * len(self._core.pool.endpoints)

    # ---- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop receiving, close the sockets, drop what is staged; bounded (about 2 s). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_metrics()
        self._core.close()  # a next() waiting for a batch sees the error within POLL_S and lets go of the lock
        with self._lock:
            self._staging.close()
        self._stop_local_producer()

    def __enter__(self) -> "TorchInput":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
