"""The right-sizing estimate on given rates and an injected clock: no timing, no sockets.

What a trainer's demand is (consumed, or more by the share of time it waited), what a producer can supply (its
workers' rows per second of work, waiting to hand off excluded), and how the fractional need becomes a number:
prompt up, held and clear down, no flapping near a boundary, and one rounding for a job's trainers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.consumer.sizing.demand import DemandMeter
from stoker.consumer.sizing.policy import SizingPolicy
from stoker.consumer.sizing.pool_sizing import PoolSizer
from stoker.consumer.sizing.supply import LOCAL_PRODUCER_PREFIX, SupplyMeter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_demand(meter: DemandMeter, clock: Clock, seconds: float, batches_per_s: float, queued: int,
               waited_per_s: float = 0.0, dt: float = 0.05) -> None:
    """Feed ``seconds`` of samples: ``batches_per_s`` consumed, ``queued`` in the queue, ``waited_per_s`` timed."""
    delivered = getattr(meter, "_test_delivered", 0.0)
    for _ in range(round(seconds / dt)):
        if waited_per_s:  # the trainer blocks on its queue for part of each interval, then steps
            meter.begin_wait()
            clock.now += waited_per_s * dt
            meter.end_wait()
            clock.now += (1 - waited_per_s) * dt
        else:
            clock.now += dt
        delivered += batches_per_s * dt
        meter.sample(int(delivered) + queued, queued)
    meter._test_delivered = delivered  # type: ignore[attr-defined]


def test_demand_is_what_was_consumed_when_the_trainer_did_not_wait():
    clock = Clock()
    meter = DemandMeter(batch_size=64, window_s=10, clock=clock)
    meter.time_waits()
    assert meter.estimate() is None  # nothing yet
    run_demand(meter, clock, 12, batches_per_s=10, queued=4)
    d = meter.estimate()
    assert d is not None and not d.input_bound and d.wait_timed
    assert d.images_per_s == pytest.approx(640, rel=0.02) and d.consumed_images_per_s == pytest.approx(640, rel=0.02)


def test_an_input_bound_trainer_demands_more_than_it_got_by_the_share_it_waited():
    clock = Clock()
    meter = DemandMeter(batch_size=64, window_s=10, clock=clock)
    meter.time_waits()
    run_demand(meter, clock, 12, batches_per_s=5, queued=0, waited_per_s=0.5)  # half the time waiting
    d = meter.estimate()
    assert d is not None and d.input_bound and d.wait_fraction == pytest.approx(0.5, abs=0.01)
    assert d.consumed_images_per_s == pytest.approx(320, rel=0.02) and d.images_per_s == pytest.approx(640, rel=0.03)


def test_without_timed_waits_an_empty_queue_counts_as_waiting_and_a_full_one_does_not():
    clock = Clock()
    meter = DemandMeter(batch_size=10, window_s=10, clock=clock)  # a graph-fed facade: no time_waits()
    run_demand(meter, clock, 12, batches_per_s=10, queued=3)
    full = meter.estimate()
    assert full is not None and full.wait_fraction == 0 and not full.wait_timed
    empty = DemandMeter(batch_size=10, window_s=10, clock=clock)
    run_demand(empty, clock, 12, batches_per_s=10, queued=0)
    d = empty.estimate()
    # Empty at every sample: read as waiting almost always, so demand is capped at MAX_DEMAND_FACTOR x consumed.
    assert d is not None and d.input_bound and d.images_per_s == pytest.approx(20 * 100, rel=0.05)


def test_a_wait_longer_than_the_window_is_booked_where_it_was_not_all_in_the_window_it_ends_in():
    """Producers still starting: the first batch took 30 s. The windows after it must read the step's own rate,
    not 20x it (the whole wait booked at its end, in a window it mostly preceded)."""
    clock = Clock()
    meter = DemandMeter(batch_size=10, window_s=10, clock=clock)
    meter.time_waits()
    meter.begin_wait()
    for _ in range(600):  # 30 s waiting, sampled: nothing consumed, so no reading
        clock.now += 0.05
        meter.sample(0, 0)
        assert meter.estimate() is None
    meter.end_wait()
    readings = []
    for i in range(1, 401):  # then 20 s of steady steps at 10 batches/s, never waiting
        clock.now += 0.05
        meter.sample(i // 2, 0)
        d = meter.estimate()
        if d is not None:
            readings.append(d.images_per_s)
    assert readings and max(readings) <= 100 * 1.05  # never more than the step's rate (100 images/s)
    assert readings[-1] == pytest.approx(100, rel=0.02)


def test_a_paused_trainer_says_nothing_about_its_step():
    clock = Clock()
    meter = DemandMeter(batch_size=8, window_s=5, clock=clock)
    run_demand(meter, clock, 10, batches_per_s=0, queued=8)
    assert meter.estimate() is None


def test_capacity_is_rows_per_second_of_work_summed_over_workers_and_waiting_to_send_is_not_work():
    clock = Clock()
    supply = SupplyMeter(window_s=60, tau_s=30, clock=clock)
    for _ in range(20):
        clock.now += 0.5
        for worker in range(4):  # each worker: 64 rows in 0.5 s of work, plus 1.5 s blocked handing off
            supply.batch("p0", worker, 64, {"read": 0.1, "decode": 0.3, "augment": 0.1, "send": 1.5})
        supply.batch("p1", 0, 64, {"decode": 1.0})  # one worker, 64 rows/s
    s = supply.estimate()
    assert s is not None and s.producers == 2
    assert s.total_images_per_s == pytest.approx(4 * 128 + 64) and s.per_producer_images_per_s == pytest.approx(288)
    clock.now += 61  # nothing heard within the window: no estimate rather than a stale one
    assert supply.estimate() is None


def test_a_producer_shared_by_many_trainers_is_read_whole_from_the_workers_one_trainer_hears():
    """256 trainers share a producer of 16 workers: one trainer hears a few of them. Its capacity is the workers'
    mean rate times 16 (the highest worker index heard, plus one), not the sum of the few heard."""
    clock = Clock()
    supply = SupplyMeter(clock=clock)
    for worker in (2, 7, 15):  # the workers this trainer happened to get a batch from
        clock.now += 1
        supply.batch("p0", worker, 128, {"decode": 0.25})  # 512 images/s each
    s = supply.estimate()
    assert s is not None and s.per_producer_images_per_s == pytest.approx(16 * 512)


def test_producers_on_the_trainers_host_are_counted_apart_and_the_need_is_what_they_leave():
    clock = Clock()
    sizer = PoolSizer(batch_size=10, headroom=0.0, clock=clock)
    sizer.demand.time_waits()
    run_demand(sizer.demand, clock, 5, batches_per_s=100, queued=2)  # 1,000 images/s
    sizer.supply.batch("remote-a", 0, 300, {"decode": 1.0})  # remote producers: 300 images/s each
    sizer.supply.batch("remote-b", 0, 300, {"decode": 1.0})
    sizer.supply.batch("local-trainer0-1-ab12", 0, 400, {"decode": 1.0})  # the trainer's host: 400 images/s
    s = sizer.update(pool_producers=3)
    assert s.supply.per_producer_images_per_s == pytest.approx(300) and s.supply.local_images_per_s == 400
    assert s.producers_needed == pytest.approx(600 / 300, rel=0.03)  # (1,000 - 400) / 300 remote producers
    assert "the 1 on this host make 400" in s.why
    from stoker.consumer.placement.local_process import local_producer_id

    assert local_producer_id().startswith(LOCAL_PRODUCER_PREFIX)  # the ids placement gives are the ones counted


def test_untimed_batches_say_nothing_and_the_table_of_workers_is_bounded():
    clock = Clock()
    supply = SupplyMeter(max_workers=8, clock=clock)
    supply.batch("pre-made", 0, 64, {})  # --repeat-batches: no work timed
    assert supply.estimate() is None
    for i in range(100):
        clock.now += 1
        supply.batch(f"p{i}", 0, 10, {"decode": 1.0})
    s = supply.estimate()
    assert s is not None and s.producers == 8  # the stalest dropped first


def test_up_is_prompt_down_waits_for_the_hold_and_goes_to_the_largest_need_seen_while_holding():
    clock = Clock()
    policy = SizingPolicy(down_margin=0.15, down_hold_s=60, clock=clock)
    assert policy.decide(None) is None
    assert policy.decide(2.6) == 3
    assert policy.decide(4.2) == 5  # up at once
    for need in (1.1, 1.5, 0.9):  # well below: held
        clock.now += 20
        assert policy.decide(need) == 5
    clock.now += 20
    assert policy.decide(1.0) == 2  # 60 s below; the largest seen while holding: ceil(1.5 x 1.15) = 2
    clock.now += 1
    assert policy.decide(2.5) == 3


def test_a_need_at_a_boundary_does_not_flap():
    """Noise around 2.0: up to 3 once, and never back down, since ceil(1.9 x 1.15) = 3."""
    clock = Clock()
    policy = SizingPolicy(down_margin=0.15, down_hold_s=30, clock=clock)
    answers = []
    for i in range(600):
        clock.now += 1
        answers.append(policy.decide(2.0 + (0.1 if i % 3 == 0 else -0.1)))
    assert set(answers) == {3}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 50, allow_nan=False), min_size=1, max_size=200))
def test_the_answer_is_never_below_the_need_right_after_a_rise_and_stays_in_bounds(needs):
    clock = Clock()
    policy = SizingPolicy(down_hold_s=10, min_producers=1, max_producers=32, clock=clock)
    for need in needs:
        clock.now += 1
        answer = policy.decide(need)
        assert answer is not None and 1 <= answer <= 32
        assert answer >= min(32, math.ceil(need - 1e-9))  # never below the need: up is at once


def test_trainers_sharing_a_pool_add_fractional_needs_and_round_once():
    """16 trainers each needing 0.3 producers: the job needs ceil(4.8) = 5, not 16 (what rounding each would give)."""
    clock = Clock()
    needs = []
    for _ in range(16):
        sizer = PoolSizer(batch_size=10, headroom=0.0, clock=clock)
        sizer.demand.time_waits()
        run_demand(sizer.demand, clock, 5, batches_per_s=3, queued=2)  # 30 images/s each
        sizer.supply.batch("p0", 0, 100, {"decode": 1.0})  # a producer makes 100 images/s
        sizing = sizer.update(pool_producers=5)
        assert sizing.producers_needed == pytest.approx(0.3, rel=0.03) and sizing.desired_producers == 1
        needs.append(sizing.producers_needed)
    job = SizingPolicy(clock=clock)
    assert job.decide(sum(needs)) == 5


def test_the_reading_explains_itself():
    clock = Clock()
    sizer = PoolSizer(batch_size=32, headroom=0.15, clock=clock)
    assert sizer.update(3).desired_producers is None and "no reading yet" in sizer.latest.why
    sizer.demand.time_waits()
    run_demand(sizer.demand, clock, 5, batches_per_s=10, queued=0, waited_per_s=0.5)
    sizer.supply.batch("p0", 0, 64, {"decode": 0.5})
    s = sizer.update(3)
    # demand 640/s (waiting half the time) x 1.15 / 128 per producer = 5.75 -> 6
    assert s.producers_needed == pytest.approx(5.75, rel=0.03) and s.desired_producers == 6
    assert "input-bound" in s.why and "-> 6" in s.why and s.as_dict()["pool_producers"] == 3
