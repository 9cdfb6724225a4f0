"""Exact mode's input state, owned in one place: this trainer's id and every record its steps consumed.

``ConsumedLedger`` is what ``save_state()`` packs and ``restore_state()`` / ``resume_state=`` load (the
bytes are ``state.pack_state``'s), for every facade alike, and the one exact-mode object a facade talks
to: ``activate()`` before the first batch is taken, ``consumed(...)`` as a step takes one. The control
plane (``ExactControlPlane``) attaches itself: it reads the ledger when it says hello (the trainer id, the
records consumed), asks it to mark records as steps consume them (``mark``) and to drop epochs every trainer
consumed (``note_stream``), and is active once ``started``. The ledger is the one writer of the state: an
elastic pool's scheduler reads the progress lent to it (``pool_progress``) and reports each epoch it completes
(``complete_pool_epoch``), which the ledger writes. No facade holds a copy of the trainer id. The ledger also
owns the one column exact mode adds to each queued batch, ``stoker_source`` (which producer a batch came from,
to report its records there): ``with_source`` gives the queue's spec, ``source_column`` makes it, ``source_of``
reads it back.
Thread-safe: every method takes ``lock`` itself, except ``mark``, whose caller holds it.
"""

from __future__ import annotations

import secrets
import threading
from typing import Callable, Optional, Sequence

import numpy as np

from stoker.protocol.peer_ids import is_valid_id
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.input_state import InputState, Progress, StreamKey

from stoker.consumer.exact.state import SavedState, pack_state, parse_state
from stoker.consumer.exact.state import state_for_share

#: the array exact mode appends to each queued batch: the number of the producer it came from
SOURCE = "stoker_source"


class ConsumedLedger:
    """The trainer id and the consumed records; see the module doc. ``started`` once batches may be queued."""

    def __init__(self, trainer_id: str, state: InputState, share: tuple[int, int] = (0, 1)) -> None:
        #: guards the records; the control plane holds it while it reads them or derives from them
        self.lock = threading.Lock()
        self._trainer_id = trainer_id
        self._state = state
        self.share = share  #: (rank, world): which of the job's trainers this is
        self._splits: dict[str, int] = {}  # elastic pool stream -> records per split, as this trainer cuts epochs
        self._job_completed: dict[str, int] = {}  # stream -> epochs complete for the whole job (a job state said)
        self.started = False
        self._on_consumed: Optional[Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]] = None

    @classmethod
    def start(cls, resume_state: Optional[bytes], trainer_id: Optional[str],
              share: tuple[int, int] = (0, 1)) -> "ConsumedLedger":
        """From ``resume_state`` (its trainer id comes with it: ``state.state_for_share`` for a job state),
        else ``trainer_id`` (default: a random one). ``share``: ``(rank, world)`` of this trainer in its job."""
        if trainer_id is not None and not is_valid_id(trainer_id):
            raise ValueError(f"trainer_id {trainer_id!r} must be 1-128 printable ASCII characters without spaces "
                             "(the producers refuse any other)")
        ledger = cls(trainer_id or f"trainer-{secrets.token_hex(4)}", InputState(), share)
        if resume_state:
            ledger._take(state_for_share(parse_state(resume_state), share))
        return ledger

    def _take(self, saved: SavedState) -> None:
        """Continue from ``saved`` (as ``state_for_share`` made it for this share); the caller holds ``lock`` or
        no other thread has the ledger yet."""
        self._trainer_id, self._state = saved.trainer, saved.state
        self._splits, self._job_completed = dict(saved.splits), dict(saved.job_completed)

    def attach(self, on_consumed: Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]) -> None:
        """The control plane's hook for the records a step consumed (``source, epochs, indices, mask``)."""
        self._on_consumed = on_consumed

    def activate(self) -> None:
        """Batches may be taken from now on (the first get(), next() or start()): no restore after this."""
        with self.lock:  # a restore either happened before this or is refused: never a hello with a stale state
            self.started = True

    def consumed(self, source: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """A step was given these rows of a batch from producer ``source`` (any thread; -1: an end marker)."""
        if self._on_consumed is not None:
            self._on_consumed(source, epochs, indices, mask)

    @property
    def trainer_id(self) -> str:
        return self._trainer_id

    @property
    def state(self) -> InputState:
        """The records themselves, for the control plane (hold ``lock``)."""
        return self._state

    def snapshot(self) -> InputState:
        """A copy of the records consumed so far (what a checkpoint saves)."""
        with self.lock:
            return self._state.copy()

    def consumed_epochs(self) -> int:
        """Epochs whose records of this trainer's share are all consumed, the least over its streams (0 before any
        is known): an elastic pool's completed epochs (its scheduler closes them, failed records included); a fixed
        shard's, plus the open epochs at their front whose every record was consumed."""
        with self.lock:
            return min((_whole_epochs(p) for p in self._state.streams.values()), default=0)

    def note_stream(self, stream: str, completed: int) -> None:
        """A producer of ours serves ``stream`` and says every trainer consumed its epochs before ``completed``:
        their bitmaps go, so the state stays small. A fixed shard is named in the state from now on, even before a
        record of it is consumed: a job state of fixed shards must not shrink (``state.state_for_share``), and only
        the state says it reads fixed shards. The caller holds ``lock``."""
        if not StreamKey.names_pool(stream):
            self._state.progress(stream)
        progress = self._state.streams.get(stream)
        if progress is not None:
            progress.advance(completed)

    def pool_progress(self, stream: str) -> Progress:
        """Elastic pool ``stream``'s progress (named in the state from now on), lent to the pool's scheduler to
        read (the epochs complete, the records consumed of the open ones); it completes an epoch through
        ``complete_pool_epoch``. The caller holds ``lock`` (the control plane, making the scheduler)."""
        return self._state.progress(stream)

    def complete_pool_epoch(self, stream: str, epoch: int) -> None:
        """Epoch ``epoch`` of elastic pool ``stream`` is complete: every record of this trainer's share in it was
        consumed or failed (the pool's scheduler says so, in order); its bitmap goes. The caller holds ``lock``
        (the scheduler is used under it)."""
        self._state.streams[stream].advance(epoch + 1)

    def note_split(self, stream: str, split: int) -> None:
        """Elastic pool ``stream``'s epochs are cut in splits of ``split`` records (saved: merging needs it).
        The caller holds ``lock`` (the control plane, as it makes the pool's scheduler)."""
        self._splits[stream] = split

    def mark(self, stream: str, epochs: np.ndarray, indices: np.ndarray) -> None:
        """These records of ``stream`` were consumed by a step. The caller holds ``lock`` (the control plane, as a
        step reports them)."""
        assert self.lock.locked(), "ConsumedLedger.mark: hold ledger.lock"
        self._state.mark(stream, epochs, indices)

    def saved(self) -> SavedState:
        """What a checkpoint saves: the id, a copy of the records, the share and how pool epochs were cut."""
        with self.lock:
            state = self._state.copy()
            splits = {k: v for k, v in self._splits.items() if k in state.streams}
            job_completed = {k: min(v, state.streams[k].completed) for k, v in self._job_completed.items()
                             if k in state.streams}
            return SavedState(self._trainer_id, state, self.share, splits, None, job_completed)

    def save_state(self) -> bytes:
        return pack_state(self.saved())

    def restore_state(self, data: bytes) -> None:
        """Continue from ``save_state()`` bytes or a job state (``merge_states``) as this trainer's share;
        RuntimeError once batches may be queued, ValueError for bad bytes or a state this share cannot take."""
        saved = state_for_share(parse_state(data), self.share)
        with self.lock:
            if self.started:
                raise RuntimeError("restore the input state before the first get() / as_dataset() / start() / "
                                   "next(): after that, batches chosen under the old state may already be queued")
            self._take(saved)

    @staticmethod
    def with_source(spec: BatchSpec) -> BatchSpec:
        """The queue's spec: ``spec`` plus the ``stoker_source`` column, last."""
        return BatchSpec.from_dict({**{a.name: (a.dtype, a.shape) for a in spec.arrays},
                                    SOURCE: ("int32", [spec.batch_size])})

    @staticmethod
    def source_column(producer: int, rows: int, empty: Callable[[np.dtype, tuple[int, ...]], np.ndarray]) -> np.ndarray:
        """The ``stoker_source`` array of a batch from producer number ``producer`` (in memory ``empty`` gives)."""
        column = empty(np.dtype(np.int32), (rows,))
        column[...] = producer
        return column

    @staticmethod
    def source_of(arrays: Sequence[np.ndarray]) -> int:
        """The producer a queued batch came from (its ``stoker_source``, the last array; -1: an end marker)."""
        return int(arrays[-1][0])


def _whole_epochs(progress: Progress) -> int:
    """``progress.completed``, plus the open epochs after it whose records are all consumed (a fixed shard's epoch completes
    in the state only when its producer says every trainer consumed it)."""
    epoch = progress.completed
    while progress.whole(epoch):
        epoch += 1
    return epoch
