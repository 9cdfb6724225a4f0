"""Resume on another number of trainers (issue 32): the states of a job's ranks merge into one job state, and any
rank of any world continues from it with each record of the open epochs served to exactly one new rank.

The shares are judged by the elastic pool's own ``SplitEpoch`` (what a new rank's scheduler will ask for), not by
a re-implementation in the test. Process-level: tests/torch_facade/test_torch_world_change.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.consumer import merge_states
from stoker.consumer.exact.ledger import ConsumedLedger
from stoker.consumer.exact.pool.split_epoch import SplitEpoch, share_mask
from stoker.consumer.exact.pool.split_plan import split_records
from stoker.consumer.exact.state import SavedState, pack_state, parse_state
from stoker.consumer.exact.state import merge_saved, state_for_share
from stoker.protocol.input_state import InputState, StreamKey, StreamProgress, epoch_order

RECORDS, SEED, BATCH = 20000, 5, 8  # splits of 128, 128, 104 and 72 records for worlds 1-4: cut differently
POOL = f"splits:{RECORDS}:{SEED}"
ORDERS = {e: epoch_order(np.arange(RECORDS, dtype=np.int64), SEED, e) for e in range(4)}


def _share(e: int, rank: int, world: int) -> np.ndarray:
    return share_mask(ORDERS[e], split_records(RECORDS, BATCH, world), rank, world)


def _rank_state(rank: int, world: int, consumed: dict[int, np.ndarray], trainer: str = "") -> SavedState:
    """Rank ``rank``'s saved state after consuming ``consumed`` (epoch -> bool [records]) of its share, its
    complete epochs closed at the front as its scheduler closes them."""
    progress = StreamProgress(RECORDS)
    for e, bits in consumed.items():
        assert not (bits & ~_share(e, rank, world)).any(), "a rank consumes only its share"
        progress.consumed(e)[:] |= bits
    while progress.completed in progress.open and (progress.open[progress.completed] | ~_share(
            progress.completed, rank, world)).all():
        progress.advance(progress.completed + 1)
    return SavedState(trainer or f"t{rank}", InputState({POOL: progress}), (rank, world),
                      {POOL: split_records(RECORDS, BATCH, world)})


def _new_ranks_take(job: SavedState, world: int, epoch: int) -> list[np.ndarray]:
    """What each rank of a new job of ``world`` will ask for in ``epoch``: the records not arrived in its
    scheduler's epoch (the pool's own bookkeeping)."""
    wanted = []
    for rank in range(world):
        state = state_for_share(parse_state(pack_state(job)), (rank, world)).state
        progress = state.streams.get(POOL, StreamProgress(RECORDS))
        epoch_state = SplitEpoch(ORDERS[epoch], progress.consumed(epoch).copy(), split_records(RECORDS, BATCH, world),
                                 rank, world)
        wanted.append(~epoch_state.arrived)
    return wanted


@settings(max_examples=60, deadline=None)
@given(old_world=st.integers(1, 4), new_world=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_every_record_the_old_ranks_left_is_asked_for_by_exactly_one_new_rank(old_world, new_world, seed):
    rng = np.random.default_rng(seed)
    truth = {e: np.zeros(RECORDS, bool) for e in range(3)}
    states = []
    for rank in range(old_world):
        consumed = {}
        for e in range(3):  # epoch 0 mostly done, 1 half, 2 begun: each rank consumes part of its share
            share = _share(e, rank, old_world)
            bits = share & (rng.random(RECORDS) < (0.97, 0.5, 0.05)[e])
            if rng.random() < 0.5 and e == 0:
                bits = share.copy()  # this rank completed epoch 0: its bitmap is dropped, only its share counts
            consumed[e] = bits
            truth[e] |= bits
        states.append(_rank_state(rank, old_world, consumed))
    rng.shuffle(states)  # any order
    job = parse_state(merge_states([pack_state(s) for s in states]))
    assert job.trainers == [f"t{r}" for r in range(old_world)]
    progress = job.state.streams[POOL]
    for e in range(3):
        np.testing.assert_array_equal(progress.consumed(e), truth[e])
        wanted = _new_ranks_take(job, new_world, e)
        asked = np.sum(wanted, axis=0)
        np.testing.assert_array_equal(asked, (~truth[e]).astype(int))  # once each, and only what is left


def test_an_epoch_every_rank_completed_is_completed_in_the_job_state_and_dropped():
    states = [_rank_state(r, 2, {0: _share(0, r, 2), 1: _share(1, r, 2) & (np.arange(RECORDS) < 10)})
              for r in range(2)]
    assert all(s.state.streams[POOL].completed == 1 for s in states)
    job = merge_saved(states)
    progress = job.state.streams[POOL]
    assert progress.completed == 1 and list(progress.open) == [1]
    np.testing.assert_array_equal(progress.open[1], np.arange(RECORDS) < 10)


def test_new_ranks_take_the_old_ranks_ids_and_new_ones_get_their_own():
    job = merge_saved([_rank_state(r, 2, {0: _share(0, r, 2)}, trainer=f"job-{r}") for r in range(2)])
    ids = [ConsumedLedger.start(pack_state(job), None, (r, 3)).trainer_id for r in range(3)]
    assert ids == ["job-0", "job-1", "job-0+r2"]
    assert ConsumedLedger.start(pack_state(job), None, (0, 1)).trainer_id == "job-0"
    # a lone trainer's state is a job state already: ranks of a bigger job take it as it is
    alone = pack_state(_rank_state(0, 1, {0: np.arange(RECORDS) < 5}, trainer="solo"))
    assert [ConsumedLedger.start(alone, None, (r, 2)).trainer_id for r in range(2)] == ["solo", "solo+r1"]
    assert parse_state(merge_states([alone])).trainers == ["solo"]


def test_a_ledger_saves_its_share_and_how_it_cut_pool_epochs():
    ledger = ConsumedLedger.start(None, "me", (1, 3))
    with ledger.lock:
        ledger.pool_progress(POOL)
        ledger.note_split(POOL, 8)
    saved = parse_state(ledger.save_state())
    assert (saved.trainer, saved.share, saved.splits, saved.trainers) == ("me", (1, 3), {POOL: 8}, None)
    assert ConsumedLedger.start(ledger.save_state(), None, (1, 3)).trainer_id == "me"  # its own state, as before


def test_an_older_state_without_a_share_is_the_loading_ranks_own_and_is_never_merged(caplog):
    import msgpack

    old = msgpack.packb({"format": "stoker-zmqinput-state", "trainer": "old", "state": InputState().to_wire()},
                        use_bin_type=True)
    saved = parse_state(old)
    assert (saved.legacy, saved.splits, saved.trainers, saved.is_job_state) == (True, {}, None, False)
    assert ConsumedLedger.start(old, None, (0, 1)).trainer_id == "old" and not caplog.records
    assert ConsumedLedger.start(old, None, (1, 2)).trainer_id == "old"  # as the earlier version took it
    assert "saved by an earlier Stoker without its rank" in caplog.text
    with pytest.raises(ValueError, match="earlier Stoker .* cannot be merged"):
        merge_states([old])


@pytest.mark.parametrize("case, message", [
    ("missing", "rank(s) [1] of 3 are missing"),
    ("worlds", "jobs of [2, 3] ranks"),
    ("twice", "two states of the same rank"),
    ("same id", "two ranks go by one trainer id"),
    ("job state", "a merged job state cannot be merged"),
    ("none", "no input state to merge"),
])
def test_states_that_are_not_one_jobs_are_refused_naming_why(case, message):
    def rank(r, w, trainer=""):
        return pack_state(_rank_state(r, w, {}, trainer))
    job = merge_states([rank(0, 2), rank(1, 2)])
    states = {"missing": [rank(0, 3), rank(2, 3)], "worlds": [rank(0, 2), rank(1, 3)],
              "twice": [rank(0, 2), rank(0, 2, "x"), rank(1, 2)], "same id": [rank(0, 2, "a"), rank(1, 2, "a")],
              "job state": [job, rank(0, 2)], "none": []}[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        merge_states(states)


def test_one_ranks_own_state_is_refused_by_a_trainer_of_another_share_naming_the_merge():
    state = pack_state(_rank_state(0, 2, {0: _share(0, 0, 2)}))
    with pytest.raises(ValueError, match=r"rank 0 of 2's alone.*stoker state merge"):
        ConsumedLedger.start(state, None, (0, 3))
    ledger = ConsumedLedger.start(None, None, (1, 2))
    with pytest.raises(ValueError, match="Merge the states of all 2 ranks"):
        ledger.restore_state(state)


def test_a_fixed_shard_job_resumes_on_at_least_as_many_trainers():
    key = "0/1:16:3"
    states = [pack_state(SavedState(f"f{r}", InputState({key: StreamProgress(16, 0, {0: np.arange(16) % 2 == r})}),
                                    (r, 2))) for r in range(2)]
    job = merge_states(states)
    progress = parse_state(job).state.streams[key]
    assert progress.completed == 1 and not progress.open  # the two halves make the epoch whole
    assert ConsumedLedger.start(job, None, (2, 3)).trainer_id == "f0+r2"
    with pytest.raises(ValueError, match=r"fixed-shard exact job of 2 trainers cannot resume on 1.*\['f1'\]"):
        ConsumedLedger.start(job, None, (0, 1))


def test_a_completed_pool_epoch_without_its_split_size_cannot_be_merged():
    states = [_rank_state(0, 2, {0: _share(0, 0, 2) & (np.arange(RECORDS) < 50)}), _rank_state(1, 2, {0: _share(0, 1, 2)})]
    assert merge_saved(states).state.streams[POOL].completed == 0
    states[1].splits = {}  # rank 1 completed epoch 0: which records that covers needs its split size
    with pytest.raises(ValueError, match="without saying how it cut them"):
        merge_saved(states)


def test_states_saved_far_apart_are_not_one_jobs():
    states = [_rank_state(r, 2, {}) for r in range(2)]
    states[0].state.streams[POOL] = StreamProgress(RECORDS, completed=500)
    with pytest.raises(ValueError, match="500 epochs apart"):
        merge_saved(states)


def test_stoker_state_merge_writes_a_job_state_and_info_describes_it(tmp_path):
    import subprocess
    import sys

    files = []
    for r in range(2):
        files.append(tmp_path / f"rank{r}.state")
        files[-1].write_bytes(pack_state(_rank_state(r, 2, {0: _share(0, r, 2) & (np.arange(RECORDS) < 40)})))
    stoker = [sys.executable, "-m", "stoker.cli.main"]
    out = subprocess.run([*stoker, "state", "merge", *map(str, files), "-o", str(tmp_path / "job.state")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "job state of 2 rank(s): t0, t1" in out.stdout and "give it to every rank" in out.stdout
    job = parse_state((tmp_path / "job.state").read_bytes())
    np.testing.assert_array_equal(job.state.streams[POOL].open[0], np.arange(RECORDS) < 40)
    info = subprocess.run([*stoker, "state", "info", str(files[0])], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0 and "trainer t0, rank 0 of 2 (merge it" in info.stdout, info.stderr
    assert f"{POOL}, split 128: 0 epoch(s) complete; epoch 0:" in info.stdout
    missing = subprocess.run([*stoker, "state", "merge", str(files[1]), "-o", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "rank(s) [0] of 2 are missing" in missing.stderr
    assert not (tmp_path / "x").exists()


def test_a_rank_resumed_from_a_job_state_merges_again_before_its_scheduler_cut_an_epoch():
    """A job state's completed epochs are complete for the whole job: a rank that resumed from it and saves before
    its pool scheduler noted a split size still merges (review: split sizes were dropped on restore)."""
    first = merge_saved([_rank_state(r, 2, {0: _share(0, r, 2), 1: _share(1, r, 2) & (np.arange(RECORDS) < 99)})
                         for r in range(2)])
    assert first.state.streams[POOL].completed == 1
    resumed = [ConsumedLedger.start(pack_state(first), None, (r, 3)) for r in range(3)]
    again = parse_state(merge_states([ledger.save_state() for ledger in resumed]))
    assert again.state.streams[POOL].completed == 1 and again.trainers == ["t0", "t1", "t0+r2"]
    np.testing.assert_array_equal(again.state.streams[POOL].open[1], np.arange(RECORDS) < 99)


def test_a_fixed_shard_only_some_ranks_read_is_merged_from_those_ranks_epochs():
    key = "0/1:16:3"  # per-node producers: rank 0 reads this shard, rank 1 another one
    states = [SavedState("a", InputState({key: StreamProgress(16, 70, {70: np.arange(16) < 3})}), (0, 2)),
              SavedState("b", InputState({"0/1:8:3": StreamProgress(8, 70)}), (1, 2))]
    job = merge_saved(states)
    assert job.state.streams[key].completed == 70 and job.state.streams["0/1:8:3"].completed == 70


@pytest.mark.parametrize("field, value, message", [
    ("splits", {POOL: 2**64 - 1}, "split size of 1-"), ("trainer", "has space", "valid trainer id"),
    ("job_completed", {POOL: 5}, "at most their completed"), ("share", [2, 2], "rank < world"),
])
def test_hostile_state_fields_are_refused_with_a_value_error(field, value, message):
    import msgpack

    body = {"format": "stoker-zmqinput-state", "trainer": "t", "share": [0, 1], "splits": {},
            "state": InputState({POOL: StreamProgress(RECORDS)}).to_wire(), field: value}
    with pytest.raises(ValueError, match=message):
        parse_state(msgpack.packb(body, use_bin_type=True))


def test_a_merge_that_would_expand_too_much_is_refused():
    big = "splits:99999999:1"
    states = [SavedState(f"t{r}", InputState({big: StreamProgress(99999999, 0, {})}), (r, 2)) for r in range(2)]
    states[0].state.streams[big].completed = 60
    with pytest.raises(ValueError, match="record-epochs"):
        merge_saved(states)


def test_a_pool_of_2_to_the_40_records_merges_and_is_described_while_no_epoch_needs_a_bitmap():
    """Issue 41: states name streams of up to 2**40 records; a merge that needs no union (every rank at the same
    complete epoch) works at any size, and one that would need bitmaps of such a stream is refused before it
    allocates them, naming the way out."""
    import tracemalloc

    from stoker.cli.state_commands import describe
    from stoker.protocol.input_state import MAX_RECORDS, TooManyRecordsError

    huge = f"splits:{MAX_RECORDS}:1"
    states = [SavedState(f"t{r}", InputState({huge: StreamProgress(MAX_RECORDS, completed=4)}), (r, 2),
                         {huge: 128}) for r in range(2)]
    job = parse_state(merge_states([pack_state(s) for s in states]))
    assert job.trainers == ["t0", "t1"] and job.state.streams[huge].completed == 4
    assert f"  {huge}: 4 epoch(s) complete" in describe(pack_state(job))
    states[0].state.streams[huge].completed = 5  # rank 0 one epoch ahead: the union would be a bitmap of 2**40
    tracemalloc.start()
    try:
        with pytest.raises(TooManyRecordsError, match=r"order 2 \(lazy\) is needed beyond"):
            merge_saved(states)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
