"""One epoch at a time, for any iterable facade (``BatchStream``, ``TorchInput``): ``inp.epochs()``.

    for epoch, batches in inp.epochs():      # exact mode; resumes at the epoch a restored state left open
        for batch in batches:                # this trainer's share of ``epoch``, each record once
            loss = (per_row_loss(batch) * batch["mask"]).sum() / batch["mask"].sum().clamp(min=1)
            ...
        evaluate(); lr_schedule.step()       # every rank of the job is here, after the same number of steps

The rule (docs/decisions.md, "Epochs one at a time"):

- Epoch ``e``'s iterator hands out the records of epoch ``e`` (and any older one still open) and ends once this
  trainer's share of ``e`` is consumed (``consumed_epochs > e``: every record of it handed out, or failed at its
  producer). A trainer cannot know before: its last records may still be on their way.
- A batch spanning the boundary is split: rows of later epochs are held back for the next epoch's iterator
  (``held_rows.py``), so nothing is repeated or dropped; rows count as consumed when handed out.
- With a ``sync`` (``EpochSync``: under ``torch.distributed`` the process group), the ranks agree before each
  step: they step once every rank holds a batch of ``e`` or has its share of ``e`` consumed; a rank whose share
  ran out steps on a *padding batch* (one row, ``mask`` False, ``index`` -1, never counted as consumed) until all
  are done, so every rank takes the same number of steps and no collective hangs; padding, never repeated or
  dropped records (as ``DistributedSampler`` does). A rank that holds nothing yet is waited for at most
  ``pad_after`` seconds, then the others step without it (it pads) for the rest of the epoch: ranks sharing a
  fixed-shard producer cannot know their share is done until the whole shard's epoch is consumed, which may
  need the records a waiting rank's peers hold, so waiting for "done" alone could deadlock.
  At the epoch's end the ranks all-reduce their ``consumed_epochs``: ``job_consumed_epochs`` then says the whole
  job consumed epoch ``e``. Which epoch comes first, and whether another comes at all (a finite run's end), are
  agreed the same way.
- A finite run (producers ``--epochs N``) ends after epoch N-1; an endless one never does.

Waits are the facade's (``recv_timeout`` for data; the process group's timeout for a collective). Rows of later
epochs that arrive before this epoch's last are held in memory: at most this trainer's share of one epoch (the
exact window), in practice a few batches (a later epoch's work goes out once this one's is all handed out).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional, Protocol

from stoker.consumer.epochs.held_rows import HeldBatches, Rows
from stoker.consumer.receive.queue_sink import END  # ``EpochSource._take_batch``: a finite run's last batch was taken


class EpochSync(Protocol):
    """What the ranks of one job agree on (collective: every rank calls each method in the same order)."""

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""

    def min(self, value: int) -> int:
        """The smallest ``value`` of all ranks."""


class EpochSource(Protocol):
    """What a facade gives the loop (``InputBase`` implements it over the facade's queue)."""

    def _take_batch(self, timeout: float) -> Any:
        """``(batch, Rows)`` not yet consumed, ``END``, or None if nothing came within ``timeout`` seconds; raises
        the input's error."""

    def _hand_out(self, rows: Rows) -> None:
        """These rows go to the caller now: consumed (or, ``consumed_when="marked"``, to be marked)."""

    def _waiting(self) -> None:
        """The loop is about to wait for data (what it handed out is being trained)."""

    def _padding(self, epoch: int) -> Any:
        """A one-row batch that is no record (``held_rows.padding_arrays``)."""

    @property
    def consumed_epochs(self) -> int:
        """Epochs whose records of this trainer's share are all consumed."""


class EpochLoop:
    """``epochs()`` for one input; see the module doc. ``poll``: seconds per wait, between which the loop looks
    again whether the epoch was consumed (and, with a ``sync``, agrees with the other ranks); ``pad_after``: seconds
    the ranks wait for one that holds no batch yet before stepping without it."""

    def __init__(self, source: EpochSource, sync: Optional[EpochSync], held: HeldBatches, poll: float,
                 pad_after: float = 5.0) -> None:
        self.source, self.sync, self.held, self.poll, self.pad_after = source, sync, held, poll, pad_after
        self.ended = False  # the run's END was taken
        #: epochs the whole job consumed, agreed at the last epoch's end (None: no epoch ended yet)
        self.job_consumed_epochs: Optional[int] = None
        self.steps = 0  # steps of the last epoch (padding steps included): the same on every rank

    def epochs(self) -> Iterator[tuple[int, Iterator[Any]]]:
        """``(epoch, its batches)`` until a finite run ends; see the module doc."""
        epoch = self._agree_min(self.source.consumed_epochs)
        while self._agree_any(self._more()):
            yield epoch, self._epoch(epoch)
            epoch += 1

    def _agree_any(self, flag: bool) -> bool:
        return self.sync.any(flag) if self.sync is not None else flag

    def _agree_min(self, value: int) -> int:
        return self.sync.min(value) if self.sync is not None else value

    def _more(self) -> bool:
        """Whether this trainer has anything more: a held row, or a batch that comes (waits for it: an endless run
        always has more; a finite one ends with END)."""
        while not len(self.held) and not self.ended:
            self._take()
        return bool(len(self.held))

    def _take(self) -> None:
        item = self.source._take_batch(self.poll)
        if item is END:
            self.ended = True
        elif item is not None:
            self.held.add(*item)

    def _poll_part(self, epoch: int) -> tuple[Optional[tuple[Any, Rows]], bool]:
        """``(part, done)``: the next batch (or part) of ``epoch`` if one is held or comes within one poll, and
        whether this trainer's share of ``epoch`` is consumed."""
        part = self.held.take(epoch)
        if part is not None:
            return part, False
        if self.ended or self.source.consumed_epochs > epoch:
            return None, True
        self.source._waiting()
        self._take()
        return self.held.take(epoch), False

    def _next_part(self, epoch: int) -> Optional[tuple[Any, Rows]]:
        """The next batch (or part) of ``epoch``, or None once this trainer's share of it is consumed."""
        while True:
            part, done = self._poll_part(epoch)
            if part is not None or done:
                return part

    def _agreed_part(self, epoch: int, patient: list[bool]) -> tuple[Optional[tuple[Any, Rows]], bool]:
        """With a ``sync``: ``(part, step)`` once the ranks agree, ``step`` False when every rank's share of ``epoch``
        is consumed. Every rank makes the same collective calls in the same order (each answer is the same on
        all), so none waits in one that another never reaches. ``patient[0]`` goes False once a rank was waited
        for ``pad_after`` seconds (see the module doc)."""
        assert self.sync is not None
        part, done, since = None, False, time.monotonic()
        while True:
            if part is None and not done:
                part, done = self._poll_part(epoch)
            ready = part is not None or done
            if patient[0] and not self.sync.min(int(ready)):  # someone waits for data: wait with it, boundedly
                if not self.sync.any(time.monotonic() - since > self.pad_after):
                    if part is not None:
                        self.source._waiting()  # held, not stepped on: what was handed out before is trained
                    continue
                patient[0] = False
            if self.sync.any(part is not None):
                return part, True
            if self.sync.min(int(done)):
                return None, False

    def _epoch(self, epoch: int) -> Iterator[Any]:
        self.steps = 0
        patient = [True]
        while True:
            if self.sync is None:
                part = self._next_part(epoch)
                step = part is not None
            else:
                part, step = self._agreed_part(epoch, patient)
            if not step:
                break
            self.steps += 1
            if part is None:
                yield self.source._padding(epoch)  # another rank still trains on epoch ``epoch``: step with it
                continue
            batch, rows = part
            self.source._hand_out(rows)
            yield batch
        self.job_consumed_epochs = self._agree_min(self.source.consumed_epochs)
