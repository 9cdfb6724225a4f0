"""An elastic pool's work, decided by the trainer: which producer serves which split of which epoch.

With ``--shard auto`` no producer owns a shard; the trainer owns the input state already
(exact mode), so it also hands out the work. Each epoch's order of the whole dataset
(``epoch_order(range(records), seed, epoch)``) is cut into *splits* of ``split`` positions
(``split_records``: enough splits that every producer of a growing pool can hold its share ahead,
a batch at least); this trainer's share is the splits ``s`` with ``s % world == rank`` (several
data-parallel trainers take disjoint shares, so nothing has to be agreed between them).

- ``top_up(i)`` hands producer ``i`` more splits until it has ``ahead`` unfinished ones: splits
  released by a producer that left or is stuck first, then the oldest open epoch's next split. At
  most ``EPOCHS_AHEAD`` epoch beyond the oldest incomplete one is open, as with fixed shards. The
  transport tops up the producers holding the fewest splits first, so a newcomer takes work at once.
  A producer left idle with nothing free takes a *backup* of the split the slowest holder is
  serving, when that holder's measured pace is ``BACKUP_FACTOR`` times slower than the idle
  producer's (a straggler at an epoch's end, as MapReduce's backup tasks and LATE do).
- ``stalls(now)``: a producer holding splits that made no progress for ``stall_bound()`` (the
  floor ``stall_after``, or ``STALL_FACTOR`` times the pool's recent progress gaps if longer), while
  the trainer's queue had room or other producers moved on, is *stuck*: its splits are handed to the others and it gets no new
  work until a batch of it arrives again (then it simply goes on: what it made meanwhile is
  dropped where others served it first).
- ``arrived(...)`` is asked for every batch: a row is kept only if its record belongs to an
  open epoch, to this trainer's share, and has not arrived before (nor been consumed: a restored
  checkpoint). A split handed out twice (a backup, a stuck producer that wakes up, one taken for dead
  that was not) therefore costs work (``duplicates``: wasted records), never a duplicate. Masked rows
  that carry an index are records the producer could not make (bad data): done, counted, never
  asked for again.
- ``release(i)``: producer ``i`` left the pool, disconnected or restarted: its unfinished splits
  go back, less what arrived, to be handed to the others.
- ``consumed(...)`` follows the steps; an epoch whose share is all consumed (or failed) is
  completed in the input state (its bitmap dropped); ``finished`` after ``epochs`` epochs.

Exactness follows from the trainer alone: a record is delivered to a step at most once per
epoch (``arrived``), and every record of the share is asked for until it arrived (``release``,
``stalls``). Times are ``time.monotonic()`` unless a test passes ``now``.
Not thread-safe: the transport calls it under its lock.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from stoker.protocol.exact_messages import MAX_SPLIT, WorkItem
from stoker.protocol.input_state import StreamKey, StreamProgress, epoch_order

log = logging.getLogger("stoker.consumer")

EPOCHS_AHEAD = 1
DEFAULT_AHEAD = 2  # unfinished splits each producer holds at least: one being served, one to go on with
#: Batches of work a producer holds beyond its credit: what its workers make ahead of credit (one each,
#: ``SplitServer.make_ahead``) with room to spare. With small splits, two splits were two batches, too few to keep
#: a producer's workers and credit busy: an elastic pool ran at 0.85 of its old rate in benchmarks/exact_cost.py.
PIPELINE_BATCHES = 8


def splits_ahead(split: int, batch_size: int, credit: int) -> int:
    """Unfinished splits each producer holds: ``DEFAULT_AHEAD``, or enough to cover its credit and
    ``PIPELINE_BATCHES`` more batches if that is more (what is in flight between it and the trainer)."""
    batches_per_split = max(1, split // max(1, batch_size))
    return max(DEFAULT_AHEAD, -(-(credit + PIPELINE_BATCHES) // batches_per_split))
SPLIT_BATCHES = 16  # the largest split: this many batches of records
#: The fewest splits an epoch (of one trainer's share) is cut into, where batches allow: a pool of P producers
#: holding DEFAULT_AHEAD each needs 2P of them free, and a small dataset of few large splits left a joining
#: producer without any (issue 29: 1,024 records in splits of 16 batches made two splits an epoch).
MIN_SPLITS = 64
#: Default floor of the stall bound (``stall_after``, ``--stall-after``): a producer holding work that sent no new
#: record for this long while the trainer waited is stuck. Well above a worker's first batch (spawn, imports).
STALL_AFTER_S = 10.0
STALL_FACTOR = 4.0  # the bound is at least this many times the median of the pool's recent progress gaps
BACKUP_FACTOR = 3.0  # back a split up when its holder needs this many times longer than an idle producer would
BACKUP_CHECK_S = 0.25  # idle producers look for a split to back up at most this often (it scans every holder)
_GAPS = 64  # recent progress gaps kept (a producer's time between two batches with new records)
_PACE_WEIGHT = 0.3  # weight of the newest sample in a producer's seconds-per-record average
_PACE_SAMPLES = 4  # batches a holder's pace is measured over before a backup is judged by it


def split_records(records: int, batch_size: int, world: int = 1) -> int:
    """Records per split of a pool of ``records``: whole batches, at most ``SPLIT_BATCHES``, and few enough that an
    epoch of one of ``world`` shares has ``MIN_SPLITS`` splits where the dataset allows (a batch at least).

    A function of its arguments only: trainers sharing a pool must cut epochs alike (their shares are splits)."""
    batch_size = max(1, batch_size)
    batches = max(1, min(SPLIT_BATCHES, records // max(1, world * MIN_SPLITS) // batch_size))
    if batches * batch_size <= MAX_SPLIT:
        return batches * batch_size
    return (MAX_SPLIT // batch_size) * batch_size or MAX_SPLIT


@dataclass
class _Epoch:
    order: np.ndarray  # int64 [records]: record at each position
    position: np.ndarray  # int32 [records]: position of each record
    arrived: np.ndarray  # bool [records]: arrived (held or consumed) or failed
    done: np.ndarray  # bool [records]: consumed or failed
    left: int  # records of the share not done
    split_left: np.ndarray  # int32 [splits]: records of each split of the share not arrived (0 for others')
    cursor: int = 0  # next split of the first pass
    returned: deque = field(default_factory=deque)  # splits given back by producers that left or are stuck


@dataclass
class _Pace:
    """What the scheduler knows of one producer's speed."""

    busy_since: float = 0.0  # when it last went from holding no split to holding one
    last_fresh: float = 0.0  # when a record of it last arrived first
    seconds_per_record: Optional[float] = None  # average while it held work (None: not measured yet)
    samples: int = 0  # batches the average is made of


class SplitScheduler:
    """See the module doc. ``progress``: the trainer's state of this stream (marked by the steps).
    ``stall_after``: the floor of the stall bound in seconds (None: never take a producer for stuck)."""

    def __init__(self, key: StreamKey, progress: StreamProgress, epochs: Optional[int], split: int,
                 rank: int = 0, world: int = 1, ahead: int = DEFAULT_AHEAD,
                 stall_after: Optional[float] = STALL_AFTER_S) -> None:
        if not key.splits:
            raise ValueError(f"stream {key} is not an elastic pool's")
        if not 1 <= split <= MAX_SPLIT or not 0 <= rank < world:
            raise ValueError(f"split of {split} records (1-{MAX_SPLIT}) or share {rank}/{world} is invalid")
        self.key, self.progress, self.epochs, self.split = key, progress, epochs, split
        self.rank, self.world, self.ahead, self.stall_after = rank, world, ahead, stall_after
        self.records = key.records
        self.splits = -(-self.records // split)
        if rank >= self.splits:
            raise ValueError(f"share {rank}/{world} of an elastic pool is empty: {self.records} records make only "
                             f"{self.splits} split(s) of {split}; run fewer trainers or smaller batches")
        self.open: dict[int, _Epoch] = {}
        self.assigned: dict[int, dict[tuple[int, int], None]] = {}  # producer -> its unfinished splits, in order
        self.holders: dict[tuple[int, int], list[int]] = {}  # split -> producers serving it (two: a backup)
        self.stuck: set[int] = set()  # producers taken for stuck: no new work until they deliver again
        self._hungry: set[int] = set()  # producers known, not stuck, holding fewer than ``ahead`` splits
        self._pace: dict[int, _Pace] = {}
        self._gaps: deque = deque(maxlen=_GAPS)
        self._queue_full_at = float("-inf")  # the trainer's queue was last full (producers wait for credit)
        self._backups_checked_at = float("-inf")
        self.duplicates = 0  # rows dropped: their record had arrived already (wasted work)
        self.foreign = 0  # rows dropped: not this trainer's (another share, an epoch not open)
        self.failed = 0  # records producers could not make
        self.handed_out = 0  # splits handed out, again after a release included
        self.released = 0  # splits taken back from producers that left
        self.reserved = 0  # splits handed out again because their producer was stuck
        self.backups = 0  # splits also handed to an idle producer because their holder straggled
        self.stalls_seen = 0  # times a producer was taken for stuck
        self._open_epochs()

    # ---- epochs ----------------------------------------------------------------------------

    def _mine(self, split: int) -> bool:
        return split % self.world == self.rank

    def _share_mask(self, order: np.ndarray) -> np.ndarray:
        """bool [records] by record: whether its split (in this epoch's order) is this trainer's."""
        if self.world == 1:
            return np.ones(self.records, bool)
        mine = np.zeros(self.records, bool)
        positions = np.arange(self.records)
        mine[order] = (positions // self.split) % self.world == self.rank
        return mine

    def _open(self, e: int) -> None:
        order = epoch_order(np.arange(self.records, dtype=np.int64), self.key.seed, e)
        position = np.empty(self.records, np.int32)
        position[order] = np.arange(self.records, dtype=np.int32)
        consumed = self.progress.consumed(e).copy()
        mine = self._share_mask(order)
        done = consumed | ~mine
        pending = ~consumed[order] & mine[order]  # by position
        split_left = np.bincount(np.arange(self.records) // self.split, weights=pending,
                                 minlength=self.splits).astype(np.int32)
        self.open[e] = _Epoch(order, position, consumed | ~mine, done, int((~done).sum()), split_left)

    def _open_epochs(self) -> None:
        """Open the epochs the window allows; an epoch with nothing of this trainer's share in it (a small
        dataset, several trainers) completes at once, and the window moves on."""
        while True:
            self._close_done()
            last = self.progress.completed + EPOCHS_AHEAD
            opened = False
            for e in range(self.progress.completed, last + 1):
                if e not in self.open and (self.epochs is None or e < self.epochs):
                    self._open(e)
                    opened = True
            if not opened or not any(self.open[e].left == 0 for e in self.open):
                return

    def _close_done(self) -> None:
        closed = False
        while self.progress.completed in self.open and self.open[self.progress.completed].left == 0:
            e = self.progress.completed
            del self.open[e]
            closed = True
            self.progress.advance(e + 1)
            log.info("epoch %d complete: every record of this trainer's share consumed once", e)
        for e in [e for e in self.open if e < self.progress.completed]:
            del self.open[e]
            closed = True
        if closed:  # what the closed epochs' splits left behind
            for es in [es for es in self.holders if es[0] not in self.open]:
                for p in self.holders.pop(es):
                    if p in self.assigned:
                        self.assigned[p].pop(es, None)
                        self._note_room(p)

    @property
    def finished(self) -> bool:
        return self.epochs is not None and self.progress.completed >= self.epochs

    # ---- handing out -----------------------------------------------------------------------

    def _free(self, e: int, s: int) -> bool:
        return self.open[e].split_left[s] > 0 and not self.holders.get((e, s))

    def _next_free(self) -> Optional[tuple[int, int]]:
        for e in sorted(self.open):
            epoch = self.open[e]
            while epoch.returned:
                s = epoch.returned.popleft()
                if self._free(e, s):
                    return e, s
            while epoch.cursor < self.splits:
                s = epoch.cursor
                epoch.cursor += 1
                if self._mine(s) and self._free(e, s):
                    return e, s
        return None

    def _unfinished(self, es: tuple[int, int]) -> bool:
        epoch = self.open.get(es[0])
        return epoch is not None and epoch.split_left[es[1]] > 0

    def _drop_finished(self, producer: int) -> dict[tuple[int, int], None]:
        mine = self.assigned.setdefault(producer, {})
        for es in [es for es in mine if not self._unfinished(es)]:
            del mine[es]
            self._unhold(es, producer)
        self._note_room(producer)
        return mine

    def _note_room(self, producer: int) -> None:
        if producer not in self.stuck and len(self.assigned.get(producer, ())) < self.ahead:
            self._hungry.add(producer)
        else:
            self._hungry.discard(producer)

    def _unhold(self, es: tuple[int, int], producer: int) -> None:
        holders = self.holders.get(es)
        if holders is not None and producer in holders:
            holders.remove(producer)
            if not holders:
                del self.holders[es]

    def _hold(self, producer: int, es: tuple[int, int], now: float) -> WorkItem:
        mine = self.assigned.setdefault(producer, {})
        pace = self._pace.setdefault(producer, _Pace(now, now))
        if not mine:
            pace.busy_since = now  # idle until now: its clock starts here
        mine[es] = None
        self.holders.setdefault(es, []).append(producer)
        self.handed_out += 1
        self._note_room(producer)
        return self._item(*es)

    def top_up(self, producer: int, now: Optional[float] = None) -> list[WorkItem]:
        """More splits for ``producer`` until it holds ``ahead`` unfinished ones (as work items to send); none for
        a stuck producer. One left idle with nothing free may take a backup of a straggler's split."""
        now = time.monotonic() if now is None else now
        mine = self._drop_finished(producer)
        if producer in self.stuck:
            return []
        items = []
        while len(mine) < self.ahead:
            free = self._next_free()
            if free is None:
                break
            items.append(self._hold(producer, free, now))
        if not mine and now - self._backups_checked_at >= BACKUP_CHECK_S:
            self._backups_checked_at = now
            backup = self._backup_for(producer, now)
            if backup is not None:
                self.backups += 1
                items.append(self._hold(producer, backup, now))
        return items

    def holding(self, producer: int) -> int:
        """Unfinished splits ``producer`` holds (a split is dropped from its holders as its last record arrives)."""
        return len(self.assigned.get(producer, {}))

    def wants_work(self) -> list[int]:
        """The producers a ``top_up`` could hand anything (known, not stuck, holding fewer than ``ahead``), those
        holding the fewest first: when splits are scarce a producer that joined takes the next free one."""
        return sorted(self._hungry, key=self.holding)

    def records_held(self, producer: int) -> int:
        """Records of ``producer``'s unfinished splits that have not arrived."""
        return sum(int(self.open[e].split_left[s]) for e, s in self.assigned.get(producer, {}) if e in self.open)

    def _item(self, e: int, s: int) -> WorkItem:
        epoch = self.open[e]
        start, end = s * self.split, min(self.records, (s + 1) * self.split)
        have = epoch.arrived[epoch.order[start:end]]
        return WorkItem(e, start, end, np.flatnonzero(have).tolist())

    def _give_back(self, producer: int) -> int:
        """Producer ``producer`` no longer serves its splits: those nobody else serves go back; how many."""
        mine = self.assigned.pop(producer, {})
        count = 0
        for e, s in mine:
            self._unhold((e, s), producer)
            epoch = self.open.get(e)
            if epoch is not None and epoch.split_left[s] > 0 and not self.holders.get((e, s)):
                epoch.returned.append(s)
                count += 1
        return count

    def release(self, producer: int) -> int:
        """Producer ``producer`` is gone (or restarted): its unfinished splits go back; how many."""
        count = self._give_back(producer)
        self.stuck.discard(producer)
        self._hungry.discard(producer)
        self.assigned.pop(producer, None)
        self._pace.pop(producer, None)
        self.released += count
        return count

    # ---- producers that stop serving, and stragglers ----------------------------------------

    def queue_full(self, now: Optional[float] = None) -> None:
        """The trainer's queue is full: producers wait for credit now, so nobody is judged stuck or slow."""
        self._queue_full_at = time.monotonic() if now is None else now

    def stall_bound(self) -> float:
        """Seconds without progress after which a producer holding work is stuck: the floor ``stall_after``, or
        ``STALL_FACTOR`` times the median of the pool's recent progress gaps (a producer's time between two batches
        with new records, while it held work) if longer: a pool of slow pipelines or large batches waits longer."""
        floor = self.stall_after if self.stall_after is not None else float("inf")
        if not self._gaps:
            return floor
        return max(floor, STALL_FACTOR * statistics.median(self._gaps))

    def stalls(self, now: Optional[float] = None) -> list[tuple[int, float, int]]:
        """Producers newly taken for stuck, as ``(producer, seconds without progress, records it held)``: each held
        work, made no progress for ``stall_bound()`` while the trainer's queue had room, and another producer is
        there to take its splits, which go back to be handed out again (``reserved``)."""
        if self.stall_after is None:
            return []
        now = time.monotonic() if now is None else now
        bound = self.stall_bound()
        found = []
        live = [p for p in self.assigned if p not in self.stuck]
        if len(live) < 2:
            return found  # nobody could take its work
        # The two latest progress times among them: "the others moved on" is the latest of someone else's.
        latest = sorted(((self._pace[p].last_fresh, p) for p in live if p in self._pace), reverse=True)[:2]
        remaining = len(live)
        for producer in live:
            if remaining < 2:
                break  # the last one standing keeps its work: nobody else could take it
            if not self.assigned[producer]:
                continue
            pace = self._pace.setdefault(producer, _Pace(now, now))
            # A full queue excuses silence (credit, not the producer, holds it back) unless others moved on meanwhile:
            # the receiver reads every producer in turn, so one that others outpace by the bound is not waiting.
            own = max(pace.last_fresh, pace.busy_since)
            moved = next((t for t, p in latest if p != producer), float("-inf"))
            excuse = self._queue_full_at if moved - own <= bound else float("-inf")
            if now - max(own, excuse) <= bound:
                continue
            held = self.records_held(producer)
            self.stuck.add(producer)
            self._hungry.discard(producer)
            remaining -= 1
            self.stalls_seen += 1
            self.reserved += self._give_back(producer)
            self.assigned[producer] = {}
            found.append((producer, now - max(pace.last_fresh, pace.busy_since), held))
        return found

    def _estimate(self, producer: int, samples: int = 1) -> Optional[float]:
        """Seconds per record of ``producer``, once measured over at least ``samples`` batches (else None)."""
        pace = self._pace.get(producer)
        return pace.seconds_per_record if pace is not None and pace.samples >= samples else None

    def _backup_for(self, idle: int, now: float) -> Optional[tuple[int, int]]:
        """The split to back up on idle producer ``idle``: among the splits their holders are serving (each one's
        first: later ones are queued work, which a backup would only make twice), the one of the slowest holder,
        if that holder's measured pace is ``BACKUP_FACTOR`` times ``idle``'s; None if none is, paces are not known
        yet (``_PACE_SAMPLES`` batches), or the trainer's queue was full lately (credit, not pace, limits)."""
        if now - self._queue_full_at < 1.0:
            return None
        paces = [p.seconds_per_record for p in self._pace.values() if p.seconds_per_record]
        if not paces:
            return None
        own = self._estimate(idle) or statistics.median(paces)
        worst, worst_ratio = None, BACKUP_FACTOR
        for producer, mine in self.assigned.items():
            pace = self._estimate(producer, _PACE_SAMPLES)
            if producer == idle or producer in self.stuck or not pace or not mine:
                continue
            first = next(iter(mine))
            if len(self.holders.get(first, ())) == 1 and pace / own > worst_ratio:
                worst, worst_ratio = first, pace / own
        return worst

    def _paced(self, producer: int, fresh: int, now: float) -> None:
        """A batch of ``producer`` arrived with ``fresh`` records first: it is responsive (no longer stuck, even if
        what it sends was served by others meanwhile), and its pace is measured."""
        pace = self._pace.setdefault(producer, _Pace(now, now))
        if producer in self.stuck:
            self.stuck.discard(producer)
            self._note_room(producer)
            pace.busy_since = now
        if not fresh:
            return
        began = max(pace.last_fresh, pace.busy_since, self._queue_full_at)
        if now > began and self.assigned.get(producer):
            self._gaps.append(now - began)
            sample = (now - began) / fresh
            pace.seconds_per_record = sample if pace.seconds_per_record is None else \
                (1 - _PACE_WEIGHT) * pace.seconds_per_record + _PACE_WEIGHT * sample
            pace.samples += 1
        pace.last_fresh = now

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
            records = indices[rows]
            mine = self._mine_rows(epoch, records)
            self.foreign += int((~mine & valid[rows]).sum())
            rows, records = rows[mine], records[mine]
            first = ~epoch.arrived[records]
            # A record twice in one batch counts once.
            _, unique_at = np.unique(records, return_index=True)
            once = np.zeros(len(records), bool)
            once[unique_at] = True
            first &= once
            self.duplicates += int((~first & valid[rows]).sum())
            fresh_rows, fresh = rows[first], records[first]
            epoch.arrived[fresh] = True
            touched = epoch.position[fresh] // self.split
            np.subtract.at(epoch.split_left, touched, 1)
            for s in np.unique(touched[epoch.split_left[touched] == 0]).tolist():
                for p in self.holders.pop((e, s), ()):  # done: its holders have room for the next at once
                    if p in self.assigned:
                        self.assigned[p].pop((e, s), None)
                        self._note_room(p)
            fresh_count += len(fresh)
            keep[fresh_rows] = valid[fresh_rows]
            failed = fresh[~valid[fresh_rows]]
            if len(failed):  # the producer could not make them: done, never asked for again
                self.failed += len(failed)
                self._done(epoch, failed)
        if producer is not None:
            self._paced(producer, fresh_count, now)
        self._close_done()
        self._open_epochs()
        return keep

    def _mine_rows(self, epoch: _Epoch, records: np.ndarray) -> np.ndarray:
        if self.world == 1:
            return np.ones(len(records), bool)
        return (epoch.position[records] // self.split) % self.world == self.rank

    def _done(self, epoch: _Epoch, records: np.ndarray) -> None:
        new = records[~epoch.done[records]]
        epoch.done[new] = True
        epoch.left -= len(new)

    def consumed(self, epochs: np.ndarray, indices: np.ndarray) -> None:
        """A step took these records (the input state marks them too)."""
        for e in np.unique(epochs).tolist():
            epoch = self.open.get(e)
            if epoch is not None:
                records = indices[epochs == e]
                self._done(epoch, records[(records >= 0) & (records < self.records)])
        self._close_done()
        self._open_epochs()
