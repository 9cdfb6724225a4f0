"""Exact mode's input state as bytes: the trainer id and every record its steps consumed.

What ``save_state()`` returns and ``restore_state()`` / ``resume_state=`` take, and what goes into
``tf.train.Checkpoint(input=inp)``: a msgpack map (no pickle; ``InputState.from_wire`` validates the
records) of

- ``format``, ``trainer`` (the id), ``state`` (the records): every version;
- ``share``: ``[rank, world]``, the trainer's share of an elastic pool when it saved, and ``splits``:
  ``{pool stream: records per split}``, how its epochs were cut. Together they say which records a
  *completed* epoch of this trainer covered (its share's, not the dataset's), which merging the states of
  several ranks needs (below). Absent in states of older versions: read as ``[0, 1]``, ``{}``.
- ``trainers``: a *job state* (``merge_states``), the ids of the job's ranks by rank; its records are
  every rank's, so any rank of any number of trainers may continue from it.
- ``job_completed``: ``{pool stream: epochs}`` known complete for the whole job (a job state's completed
  epochs, kept by the ranks that continue from it), so a rank that resumed and saved before its own
  scheduler cut an epoch still merges.

States without ``share`` (saved by an earlier version) are *legacy*: taken as the loading rank's own state
(as that version did), never merged, with a warning where the job has several ranks.

ValueError naming what is wrong for anything else.

**Merging** (``merge_states``, ``state_for_share``): resume on a different number of trainers.

The rule (docs/decisions.md, "Resume on another number of trainers"):

- *Merge*: the states of every rank ``0..W-1`` of one job, saved at the same step. A record counts as consumed
  in the job state when any rank consumed it; a rank's *completed* epoch covers its share only (in an elastic
  pool, the splits ``s % W == rank`` of that epoch, cut as the rank cut them: the state says its share and
  split size), so the union over ranks decides which epochs are complete for the job. Ranks consume disjoint
  records, so nothing is lost or counted twice by the union. A missing rank is an error: its records would be
  served again.
- *Take*: any rank ``r'`` of any world ``W'`` may continue from the job state: its records are the job's, and
  its share of the open epochs is what the job has not consumed (an elastic pool cuts each epoch anew for
  ``W'``; fixed shards serve whatever no trainer consumed). Rank ``r'`` goes by the id old rank ``r'`` had
  (its producers then replace what they knew of that id at once), a new rank by ``<rank 0's id>+r<r'>``.
- *Records held by old ranks* (received, never consumed by a step): nobody consumed them, so they are not in
  the job state and are served again. Records an old rank consumed *after* the saved step were trained by a
  model that was not checkpointed: served again too, as for any resume from a checkpoint. In an elastic pool
  the trainers alone decide this, so it holds for any W'. With fixed shards the producers keep each trainer
  id's consumed records until that id says hello again: an old rank's id that no new rank takes would keep
  its post-checkpoint records consumed, so a fixed-shard job resumes on at least as many ranks as it had.

``merge_states`` and ``state_for_share`` are pure functions of the bytes: ValueError naming what is wrong.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import msgpack
import numpy as np

from stoker.protocol.peer_ids import is_valid_id
from stoker.protocol.exact_messages import MAX_SPLIT
from stoker.protocol.epochs.position_ranges import PositionRanges
from stoker.protocol.input_state import InputState, Progress, RangeProgress, StreamKey, StreamProgress

from stoker.consumer.exact.pool.range_split_epoch import SplitCut
from stoker.consumer.exact.pool.split_epoch import share_mask

STATE_FORMAT = "stoker-zmqinput-state"
log = logging.getLogger("stoker.consumer")

MAX_TRAINERS = 4096
MAX_STATE_BYTES = 256 * 1024 * 1024
#: records x epochs a merge may expand to booleans at once (the sum over streams of spread x size): 1 GiB
MAX_MERGE_CELLS = 1 << 30


@dataclass
class SavedState:
    """One state as saved: see the module doc. ``trainers`` is None for one trainer's own state."""

    trainer: str
    state: InputState
    share: tuple[int, int] = (0, 1)
    splits: dict[str, int] = field(default_factory=dict)
    trainers: Optional[list[str]] = None
    job_completed: dict[str, int] = field(default_factory=dict)
    legacy: bool = False  # saved without its share (an earlier version)

    @property
    def is_job_state(self) -> bool:
        """Whether this holds every rank's records (merged, or saved by a trainer alone in its job)."""
        return not self.legacy and (self.trainers is not None or self.share[1] == 1)


def pack_state(saved: SavedState) -> bytes:
    body: dict = {"format": STATE_FORMAT, "trainer": saved.trainer, "state": saved.state.to_wire(),
                  "share": list(saved.share), "splits": dict(saved.splits), "job_completed": dict(saved.job_completed)}
    if saved.trainers is not None:
        body["trainers"] = list(saved.trainers)
    return msgpack.packb(body, use_bin_type=True)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_state(data: bytes) -> SavedState:
    """The ``pack_state`` bytes, checked; ValueError naming what is wrong."""
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"input state of {len(data)} bytes is larger than {MAX_STATE_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not an input state (save_state() bytes): invalid msgpack ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != STATE_FORMAT or not is_valid_id(body.get("trainer")):
        raise ValueError(f"not an input state (save_state() bytes: format {STATE_FORMAT!r} and a valid trainer id expected)")
    state = InputState.from_wire(body.get("state"))
    share = body.get("share", [0, 1])
    if (not isinstance(share, list) or len(share) != 2 or not all(map(_int, share))
            or not 0 <= share[0] < share[1] <= MAX_TRAINERS):
        raise ValueError(f"input state: 'share' {share!r} is not [rank, world] with 0 <= rank < world")
    splits = body.get("splits", {})
    if not isinstance(splits, dict) or not all(
            isinstance(k, str) and k in state.streams and _int(v) and 1 <= v <= MAX_SPLIT for k, v in splits.items()):
        raise ValueError(f"input state: 'splits' must map streams of the state to a split size of 1-{MAX_SPLIT}")
    job_completed = body.get("job_completed", {})
    if not isinstance(job_completed, dict) or not all(
            isinstance(k, str) and k in state.streams and _int(v) and 0 <= v <= state.streams[k].completed
            for k, v in job_completed.items()):
        raise ValueError("input state: 'job_completed' must map streams of the state to at most their completed "
                         "epochs")
    trainers = body.get("trainers")
    if trainers is not None and (not isinstance(trainers, list) or not 1 <= len(trainers) <= MAX_TRAINERS
                                 or not all(isinstance(t, str) and is_valid_id(t) for t in trainers)
                                 or len(set(trainers)) != len(trainers)):
        raise ValueError(f"input state: 'trainers' must list 1-{MAX_TRAINERS} distinct trainer ids")
    return SavedState(body["trainer"], state, (share[0], share[1]), splits, trainers, job_completed,
                      legacy="share" not in body)


# ---- merging a job's states ------------------------------------------------------------------------------

#: epochs between the least and the most advanced rank of one job: a pool opens one epoch ahead, fixed shards
#: complete epochs for every trainer; states further apart than this were not saved at one step of one job.
MAX_EPOCH_SPREAD = 64
_HOW = "give the states of every rank of one job, saved at the same step (a job state already holds them all)"


def merge_states(states: Sequence[bytes]) -> bytes:
    """The job state of one job's ranks' ``save_state()`` bytes (any order); ValueError naming what is wrong."""
    return pack_state(merge_saved([parse_state(bytes(s)) for s in states]))


def merge_saved(saved: Sequence[SavedState]) -> SavedState:
    """``merge_states`` on parsed states."""
    if not saved:
        raise ValueError(f"no input state to merge: {_HOW}")
    if any(s.legacy for s in saved):
        raise ValueError("a state saved by an earlier Stoker (without its share) cannot be merged: resume each rank "
                         "from its own state on the same number of ranks, then save again")
    if len(saved) == 1 and saved[0].is_job_state:
        only = saved[0]
        return SavedState(only.trainer, only.state, trainers=list(only.trainers or [only.trainer]),
                          job_completed={k: p.completed for k, p in only.state.streams.items()})
    if any(s.trainers is not None for s in saved):
        raise ValueError(f"a merged job state cannot be merged with others: {_HOW}")
    worlds = sorted({s.share[1] for s in saved})
    if len(worlds) != 1:
        raise ValueError(f"the states come from jobs of {worlds} ranks: {_HOW}")
    world = worlds[0]
    by_rank = {s.share[0]: s for s in saved}
    if len(by_rank) != len(saved):
        raise ValueError(f"two states of the same rank: {_HOW}")
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        raise ValueError(f"the states of rank(s) {missing} of {world} are missing: the records those ranks consumed "
                         f"would be served again; {_HOW}")
    ranks = [by_rank[r] for r in range(world)]
    trainers = [s.trainer for s in ranks]
    if len(set(trainers)) != world:
        raise ValueError(f"two ranks go by one trainer id ({trainers}): {_HOW}")
    keys = sorted({k for s in ranks for k in s.state.streams})
    budget = [MAX_MERGE_CELLS]
    merged = InputState({key: _merge_stream(key, ranks, budget) for key in keys})
    return SavedState(trainers[0], merged, trainers=trainers,
                      job_completed={k: p.completed for k, p in merged.streams.items()})


def _covered(key: StreamKey, saved: SavedState, progress: Optional[StreamProgress], epoch: int,
             orders: dict[int, np.ndarray]) -> np.ndarray:
    """bool [size]: the records of ``epoch`` this rank's state says were consumed (``orders``: epoch orders made
    so far, shared by the ranks)."""
    if progress is None:
        return np.zeros(key.size, bool)
    if epoch >= progress.completed:
        return progress.open.get(epoch, np.zeros(key.size, bool))
    rank, world = saved.share
    if not key.splits or world == 1 or epoch < saved.job_completed.get(str(key), 0):
        return np.ones(key.size, bool)  # complete for every trainer: fixed shards' epochs, a lone trainer's, a job's
    split = saved.splits.get(str(key))
    if split is None:
        raise ValueError(f"the state of trainer {saved.trainer} (rank {rank} of {world}) completed epochs of pool "
                         f"{key} without saying how it cut them: it cannot be merged")
    if epoch not in orders:
        orders[epoch] = key.order(epoch)
    return share_mask(orders[epoch], split, rank, world, key.block, key.window)


def _merge_stream(text: str, ranks: Sequence[SavedState], budget: list[int]) -> Progress:
    key = StreamKey.parse(text)
    progress = [s.state.streams.get(text) for s in ranks]
    known = [p for p in progress if p is not None]
    # A rank that never read a fixed shard (per-node producers) says nothing of its epochs; a pool is every rank's.
    low = min(p.completed if p is not None else 0 for p in (progress if key.splits else known))
    high = max(max([p.completed] + [e + 1 for e in p.open]) for p in known)
    if high - low > MAX_EPOCH_SPREAD:
        raise ValueError(f"stream {text}: the ranks' states are {high - low} epochs apart: {_HOW}")
    if key.order_version == 2:
        return _merge_ranges(key, ranks, progress, low, high)
    if high > low:
        key.check_materialisable()  # a union below is a bitmap per epoch; epochs all complete need none
    budget[0] -= (high - low) * key.size
    if budget[0] < 0:
        raise ValueError(f"merging would expand more than {MAX_MERGE_CELLS} record-epochs at once: these states are "
                         "not one job's saved at one step (or the job reads more than a merge handles)")
    union, orders = {}, {}
    for e in range(low, high):
        union[e] = np.zeros(key.size, bool)
        for s, p in zip(ranks, progress):
            union[e] |= _covered(key, s, p, e, orders)
    completed = low
    while completed < high and union[completed].all():
        completed += 1
    return StreamProgress(key.size, completed, {e: union[e] for e in range(completed, high) if union[e].any()})


def _covered_ranges(key: StreamKey, saved: SavedState, progress: Optional[Progress], epoch: int) -> PositionRanges:
    """``_covered`` in epoch order 2: the positions of ``epoch`` this rank's state says were consumed."""
    if progress is None:
        return PositionRanges(key.size)
    if epoch >= progress.completed:
        assert isinstance(progress, RangeProgress)
        found = progress.open.get(epoch)
        return found if found is not None else PositionRanges(key.size)
    rank, world = saved.share
    if not key.splits or world == 1 or epoch < saved.job_completed.get(str(key), 0):  # as in _covered
        return PositionRanges.from_ranges(np.array([0]), np.array([key.size]), key.size)
    split = saved.splits.get(str(key))
    if split is None:
        raise ValueError(f"the state of trainer {saved.trainer} (rank {rank} of {world}) completed epochs of pool "
                         f"{key} without saying how it cut them: it cannot be merged")
    return SplitCut(key.lazy_order(), epoch, key.records, split).share(rank, world, key.size)


def _merge_ranges(key: StreamKey, ranks: Sequence[SavedState], progress: list, low: int, high: int) -> RangeProgress:
    """``_merge_stream`` in epoch order 2 (a pool, or fixed shards: their completed epochs full, open ones unioned):
    unions of ranges, nothing per record."""
    union = {}
    for e in range(low, high):
        union[e] = PositionRanges(key.size)
        for s, p in zip(ranks, progress):
            union[e] = union[e].union(_covered_ranges(key, s, p, e))
    completed = low
    while completed < high and union[completed].is_full():
        completed += 1
    return RangeProgress(key.size, completed, {e: union[e] for e in range(completed, high) if union[e].count()})


def state_for_share(saved: SavedState, share: tuple[int, int]) -> SavedState:
    """What rank ``share[0]`` of ``share[1]`` continues from (its trainer id, the records, what it keeps of the
    saved state); ValueError naming the fix for a state that rank cannot take."""
    rank, world = share
    if saved.legacy:
        if world > 1:
            log.warning("this input state was saved by an earlier Stoker without its rank: taken as rank %d of %d's "
                        "own. Resuming on another number of ranks needs states saved by this version", rank, world)
        return SavedState(saved.trainer, saved.state, share)
    if not saved.is_job_state:
        if saved.share == share:
            return SavedState(saved.trainer, saved.state, share, dict(saved.splits), None, dict(saved.job_completed))
        raise ValueError(
            f"this input state is rank {saved.share[0]} of {saved.share[1]}'s alone, and this trainer is rank {rank} "
            f"of {world}: the other ranks' records are not in it. Merge the states of all {saved.share[1]} ranks "
            "first (stoker.consumer.merge_states, `stoker state merge`, or TorchInput.load_state_dict(list)); "
            "TorchInput.state_dict() under torch.distributed saves the merged job state itself")
    trainers = saved.trainers or [saved.trainer]
    fixed = sorted(k for k in saved.state.streams if not StreamKey.parse(k).splits)
    if fixed and world < len(trainers):
        raise ValueError(
            f"a fixed-shard exact job of {len(trainers)} trainers cannot resume on {world}: its producers keep what "
            f"each trainer id consumed until that id says hello again, so rank ids {trainers[world:]} would keep "
            "their records since the checkpoint consumed. Resume on at least as many trainers, restart the "
            f"producers too (they then know only what the trainers say), or run an elastic pool (--shard auto)")
    trainer = trainers[rank] if rank < len(trainers) else f"{trainers[0][:100]}+r{rank}"
    while rank >= len(trainers) and trainer in trainers:
        trainer += "+"
    job_completed = {k: p.completed for k, p in saved.state.streams.items()}
    return SavedState(trainer, saved.state, share, {}, None, job_completed)
