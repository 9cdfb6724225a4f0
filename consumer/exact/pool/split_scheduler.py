"""An elastic pool's work, decided by the trainer: which producer serves which split of which epoch.

With ``--shard auto`` no producer owns a shard; the trainer owns the input state already
(exact mode), so it also hands out the work. Each epoch's order of the whole dataset
(``epoch_order(range(records), seed, epoch)``) is cut into *splits* of ``split`` positions
(``split_records``: enough splits that every producer of a growing pool can hold its share ahead,
a batch at least); this trainer's share is the splits ``s`` with ``s % world == rank`` (in epoch order 2, blocks of
consecutive splits dealt in turn: ``range_split_epoch``) (several
data-parallel trainers take disjoint shares, so nothing has to be agreed between them).

- ``top_up(i)`` hands producer ``i`` more splits until it has ``ahead`` unfinished ones: splits
  released by a producer that left or is stuck first, then the oldest open epoch's next split. At
  most ``EPOCHS_AHEAD`` epoch beyond the oldest incomplete one is open, as with fixed shards. The
  control plane tops up the producers holding the fewest splits first, so a newcomer takes work at once.
  A producer left idle with nothing free takes a *backup* of the split the slowest holder is
  serving, when that holder's measured pace (``producer_pace``) is ``BACKUP_FACTOR`` times slower
  than the idle producer's (a straggler at an epoch's end, as MapReduce's backup tasks and LATE do).
- ``stalls(now)``: a producer holding splits that made no progress for ``pace.stall_bound()``, while the
  trainer's queue had room or other producers moved on (``producer_pace`` judges), is *stuck*: its
  splits are handed to the others and it gets no new work until a batch of it arrives again (then it
  simply goes on: what it made meanwhile is dropped where others served it first).
- ``arrived(...)`` is asked for every batch: a row is kept only if its record belongs to an
  open epoch, to this trainer's share, and has not arrived before (nor been consumed: a restored
  checkpoint). A split handed out twice (a backup, a stuck producer that wakes up, one taken for dead
  that was not) therefore costs work (``duplicates``: wasted records), never a duplicate. Masked rows
  that carry an index are records the producer could not make (bad data): done, counted, never
  asked for again.
- ``release(i)``: producer ``i`` left the pool, disconnected or restarted: its unfinished splits
  go back, less what arrived, to be handed to the others.
- ``consumed(...)`` follows the steps; an epoch whose share is all consumed (or failed) is
  reported complete (``complete(epoch)``: the ledger, the input state's one writer, drops its bitmap) and
  logged (``EpochLog``: summarised, not a line each); ``finished`` after ``epochs`` epochs. The scheduler
  only reads the state's ``progress``.

Exactness follows from the trainer alone: a record is delivered to a step at most once per
epoch (``arrived``), and every record of the share is asked for until it arrived (``release``,
``stalls``). Times are ``time.monotonic()`` unless a test passes ``now``.
Not thread-safe: the control plane calls it under its lock. ``SchedulerPlan`` (split_plan.py) makes
one once the dataset is known (the first pool producer's status).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from stoker.protocol.exact_messages import MAX_SPLIT, WorkItem
from stoker.protocol.input_state import Progress, StreamKey

from stoker.consumer.exact.pool.pool_member import PoolMembers
from stoker.consumer.exact.pool.producer_pace import PoolPace
from stoker.consumer.exact.pool.shard_affinity import ShardHoldings
from stoker.consumer.exact.pool.range_split_epoch import PoolEpoch, make_split_epoch
from stoker.consumer.exact.pool.split_epoch import EpochLog
from stoker.consumer.receive.options import STALL_AFTER_S

EPOCHS_AHEAD = 1
DEFAULT_AHEAD = 2  # unfinished splits each producer holds at least: one being served, one to go on with
BACKUP_FACTOR = 3.0  # back a split up when its holder needs this many times longer than an idle producer would
BACKUP_CHECK_S = 0.25  # idle producers look for a split to back up at most this often (it scans every holder)


class SplitScheduler:
    """See the module doc. ``progress``: the trainer's state of this stream (marked by the steps), read here;
    ``complete(epoch)``: ``epoch`` is complete, for its owner to write in it (``ConsumedLedger.complete_pool_epoch``),
    called in order of epochs. ``stall_after``: the floor of the stall bound in seconds (None: never take a
    producer for stuck)."""

    def __init__(self, key: StreamKey, progress: Progress, complete: Callable[[int], None],
                 epochs: Optional[int], split: int, rank: int = 0, world: int = 1, ahead: int = DEFAULT_AHEAD,
                 stall_after: Optional[float] = STALL_AFTER_S) -> None:
        if not key.splits:
            raise ValueError(f"stream {key} is not an elastic pool's")
        if not 1 <= split <= MAX_SPLIT or not 0 <= rank < world:
            raise ValueError(f"split of {split} records (1-{MAX_SPLIT}) or share {rank}/{world} is invalid")
        self.key, self.progress, self._complete, self.epochs, self.split = key, progress, complete, epochs, split
        self.rank, self.world, self.ahead, self.stall_after = rank, world, ahead, stall_after
        self.records = key.records
        self.splits = -(-self.records // split)  # splits of an epoch (at least: a shard layout cuts at its windows too)
        if rank >= self.splits:
            raise ValueError(f"share {rank}/{world} of an elastic pool is empty: {self.records} records make only "
                             f"{self.splits} split(s) of {split}; run fewer trainers or smaller batches")
        self.open: dict[int, PoolEpoch] = {}
        self.members = PoolMembers()  # producer -> what is known of it: its splits, stuck, pace, cache (one record)
        self.holders = self.members.holders  # split -> producers serving it (two: a backup)
        self.pace = PoolPace(stall_after, self.members)
        self._backups_checked_at = float("-inf")
        self.duplicates = 0  # rows dropped: their record had arrived already (wasted work)
        self.foreign = 0  # rows dropped: not this trainer's (another share, an epoch not open)
        self.failed = 0  # records producers could not make
        self.handed_out = 0  # splits handed out, again after a release included
        self.released = 0  # splits taken back from producers that left
        self.reserved = 0  # splits handed out again because their producer was stuck
        self.backups = 0  # splits also handed to an idle producer because their holder straggled
        self.stalls_seen = 0  # times a producer was taken for stuck
        self.epoch_log = EpochLog()  # "epoch N complete", summarised (a small dataset completes one a second)
        self.holdings = ShardHoldings(key.shards, self.members) if key.block else None  # producers' caches
        self._open_epochs()

    # ---- epochs ----------------------------------------------------------------------------

    def _open_epochs(self) -> None:
        """Open the epochs the window allows; an epoch with nothing of this trainer's share in it (a small
        dataset, several trainers) completes at once, and the window moves on."""
        while True:
            self._close_done()
            last = self.progress.completed + EPOCHS_AHEAD
            opened = False
            for e in range(self.progress.completed, last + 1):
                if e not in self.open and (self.epochs is None or e < self.epochs):
                    self.open[e] = make_split_epoch(self.key, e, self.progress.consumed(e), self.split, self.rank,
                                                    self.world)
                    opened = True
            if not opened or not any(self.open[e].left == 0 for e in self.open):
                return

    def _close_done(self) -> None:
        closed = False
        while self.progress.completed in self.open and self.open[self.progress.completed].left == 0:
            e = self.progress.completed
            del self.open[e]
            closed = True
            self._complete(e)  # the ledger writes it: progress.completed is e + 1 from now on
            self.epoch_log.completed(e, last=e + 1 == self.epochs)
        for e in [e for e in self.open if e < self.progress.completed]:
            del self.open[e]
            closed = True
        if closed:  # what the closed epochs' splits left behind
            for es in [es for es in self.holders if es[0] not in self.open]:
                self._split_done(es)

    def _split_done(self, es: tuple[int, int]) -> None:
        """Nothing of split ``es`` is left to arrive: its holders have room for the next at once."""
        for p in self.members.split_done(es):
            self._note_room(p)

    @property
    def finished(self) -> bool:
        return self.epochs is not None and self.progress.completed >= self.epochs

    # ---- handing out -----------------------------------------------------------------------

    def _free(self, e: int, s: int) -> bool:
        return self.open[e].unfinished(s) and not self.holders.get((e, s))

    def _next_free(self, producer: int) -> Optional[tuple[int, int]]:
        """The split to hand ``producer``: by its cache (``ShardHoldings``), else given back, else the next."""
        if self.holdings is not None and self.holdings.bounded:
            found = self.holdings.pick(producer, sorted(self.open.items()), self._free)
            if found is not None:
                return found
        for e in sorted(self.open):
            epoch = self.open[e]
            while epoch.returned:
                s = epoch.returned.popleft()
                if self._free(e, s):
                    return e, s
            while epoch.skip_arrived() < epoch.split_count:
                s = epoch.cursor
                epoch.cursor += 1
                if epoch.is_mine(s) and self._free(e, s):
                    epoch.mark_handed(s)
                    return e, s
        return None

    def _unfinished(self, es: tuple[int, int]) -> bool:
        epoch = self.open.get(es[0])
        return epoch is not None and epoch.unfinished(es[1])

    def _drop_finished(self, producer: int) -> dict[tuple[int, int], None]:
        mine = self.members.assign(producer)
        for es in [es for es in mine if not self._unfinished(es)]:
            self.members.unhold(producer, es)
        self._note_room(producer)
        return mine

    @property
    def stuck(self) -> frozenset[int]:
        """The producers taken for stuck: no new work until they deliver again."""
        return self.members.stuck()

    def _note_room(self, producer: int) -> None:
        member = self.members.of(producer)
        member.hungry = not member.stuck and len(member.splits or ()) < self.ahead

    def _hold(self, producer: int, es: tuple[int, int], now: float) -> WorkItem:
        self.pace.holds(producer, now, idle=not self.members.assign(producer))
        self.members.hold(producer, es)
        if self.holdings is not None:
            self.holdings.use(producer, self.open[es[0]].shard_of_split(es[1]))
        self.handed_out += 1
        self._note_room(producer)
        return self.open[es[0]].item(*es)

    def top_up(self, producer: int, now: Optional[float] = None) -> list[WorkItem]:
        """More splits for ``producer`` until it holds ``ahead`` unfinished ones (as work items to send); none for
        a stuck producer. One left idle with nothing free may take a backup of a straggler's split."""
        now = time.monotonic() if now is None else now
        mine = self._drop_finished(producer)
        if self.members.is_stuck(producer):
            return []
        items = []
        while len(mine) < self.ahead:
            free = self._next_free(producer)
            if free is None:
                break
            items.append(self._hold(producer, free, now))
        if not mine and now - self._backups_checked_at >= BACKUP_CHECK_S:
            self._backups_checked_at = now
            backup = self.pace.straggler(producer, self.members.serving(producer), now, BACKUP_FACTOR)
            if backup is not None:
                self.backups += 1
                items.append(self._hold(producer, backup, now))
        return items

    def holding(self, producer: int) -> int:
        """Unfinished splits ``producer`` holds (a split is dropped from its holders as its last record arrives)."""
        return self.members.holding(producer)

    def wants_work(self) -> list[int]:
        """The producers a ``top_up`` could hand anything (known, not stuck, holding fewer than ``ahead``), those
        holding the fewest first: when splits are scarce a producer that joined takes the next free one."""
        return self.members.hungry()

    def records_held(self, producer: int) -> int:
        """Records of ``producer``'s unfinished splits that have not arrived."""
        return sum(self.open[e].left_in(s) for e, s in self.members.splits_of(producer) if e in self.open)

    def _give_back(self, producer: int) -> int:
        """Producer ``producer`` no longer serves its splits: those nobody else serves go back; how many."""
        count = 0
        for e, s in self.members.take_back(producer):
            epoch = self.open.get(e)
            if epoch is not None and epoch.unfinished(s) and not self.holders.get((e, s)):
                epoch.returned.append(s)
                count += 1
        return count

    def release(self, producer: int) -> int:
        """Producer ``producer`` is gone (or restarted): its unfinished splits go back; how many."""
        count = self._give_back(producer)
        if self.holdings is not None:
            self.holdings.forget(producer)
        self.members.drop(producer)  # its splits, stuck, pace and cache with it
        self.released += count
        return count

    # ---- producers that stop serving -------------------------------------------------------

    def queue_full(self, now: Optional[float] = None) -> None:
        """The trainer's queue is full: producers wait for credit now, so nobody is judged stuck or slow."""
        self.pace.queue_full(time.monotonic() if now is None else now)

    def stalls(self, now: Optional[float] = None) -> list[tuple[int, float, int]]:
        """Producers newly taken for stuck, as ``(producer, seconds without progress, records it held)``: each held
        work, made no progress for ``pace.stall_bound()`` while the trainer's queue had room, and another producer is
        there to take its splits, which go back to be handed out again (``reserved``)."""
        if self.stall_after is None:
            return []
        now = time.monotonic() if now is None else now
        found: list[tuple[int, float, int]] = []
        live = [p for p, m in self.members.items() if m.splits is not None and not m.stuck]
        remaining = len(live)
        if remaining < 2:
            return found  # nobody could take its work
        for producer, silent in self.pace.overdue([p for p in live if self.members[p].splits], live, now):
            found.append((producer, silent, self.records_held(producer)))
            member = self.members[producer]
            member.stuck, member.hungry = True, False
            self.stalls_seen += 1
            self.reserved += self._give_back(producer)
            self.members.assign(producer)  # known, holding nothing
            remaining -= 1
            if remaining < 2:
                break  # the last one standing keeps its work: nobody else could take it
        return found

    # ---- what arrives and what the steps take ----------------------------------------------

    def arrived(self, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray, producer: Optional[int] = None,
                now: Optional[float] = None) -> np.ndarray:
        """Which rows of a batch (from ``producer``) to keep (see the module doc); marks them arrived."""
        now = time.monotonic() if now is None else now
        epochs, indices = np.asarray(epochs, np.int64), np.asarray(indices, np.int64)
        valid = np.asarray(mask).astype(bool)
        keep = np.zeros(len(indices), bool)
        fresh_count = 0
        for e in np.unique(epochs[indices >= 0]).tolist():
            rows = np.flatnonzero((epochs == e) & (indices >= 0))
            epoch = self.open.get(e)
            if epoch is None:
                if 0 <= e < self.progress.completed:  # a closed epoch: every record of it came before (work wasted)
                    self.duplicates += int(valid[rows].sum())
                else:
                    self.foreign += int(valid[rows].sum())
                continue
            ok = indices[rows] < self.records
            self.foreign += int((~ok & valid[rows]).sum())
            rows = rows[ok]
            records = epoch.locate(indices[rows])  # the epoch's keys: records (order 1) or positions (order 2)
            mine = epoch.mine(records)
            self.foreign += int((~mine & valid[rows]).sum())
            rows, records = rows[mine], records[mine]
            first, done_splits = epoch.arrive(records)
            self.duplicates += int((~first & valid[rows]).sum())
            for s in done_splits:
                self._split_done((e, s))
            fresh_rows = rows[first]
            fresh_count += len(fresh_rows)
            keep[fresh_rows] = valid[fresh_rows]
            failed = ~valid[fresh_rows]
            if failed.any():  # the producer could not make them: done, never asked for again
                self.failed += int(failed.sum())
                epoch.finish(records[first][failed])
        if producer is not None:
            member = self.members.get(producer)
            if member is not None and member.stuck:  # responsive again, even if others served what it sends
                member.stuck = False
                self._note_room(producer)
                self.pace.woke(producer, now)
            self.pace.delivered(producer, fresh_count, bool(self.members.holding(producer)), now)
        self._close_done()
        self._open_epochs()
        return keep

    def consumed(self, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step took these records (the input state marks them too)."""
        for e in np.unique(epochs).tolist():
            epoch = self.open.get(e)
            if epoch is not None:
                records = indices[epochs == e]
                epoch.finish(epoch.locate(records[(records >= 0) & (records < self.records)]))
        self._close_done()
        self._open_epochs()
