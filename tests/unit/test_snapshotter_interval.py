"""The snapshot interval: a fixed ``every_steps``, or ``auto`` — the most frequent interval
whose measured snapshot cost stays within ``overhead_budget`` of the step time."""
from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.runtime.snapshot.snapshotter import (AUTO_MAX_INTERVAL, UNSEEN_COST, SnapshotPolicy,
                                                  Snapshotter, _IntervalController)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def auto(step_s: float, cost_s: float, budget: float = 0.03) -> _IntervalController:
    control = _IntervalController(SnapshotPolicy("auto", budget))
    control.observe_step(step_s)
    control.observe_work(cost_s)
    return control


@pytest.mark.parametrize("every", [1, 5, 250])
def test_fixed_interval_ignores_measurements(every: int) -> None:
    control = _IntervalController(SnapshotPolicy(every, 0.03))
    assert control.interval == every
    control.observe_step(0.001)
    control.observe_work(10.0)
    assert control.interval == every


def test_auto_snapshots_every_step_until_both_times_are_measured() -> None:
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    assert control.interval == 1
    control.observe_step(0.001)
    assert control.interval == 1                 # no snapshot cost measured yet
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    control.observe_work(10.0)
    assert control.interval == 1                 # no step time measured yet


# the measured cost is planned with UNSEEN_COST (1.5) on top: what the worker cannot see
@pytest.mark.parametrize("step_s, cost_s, budget, want", [
    (1.0, 0.01, 0.03, 1),        # cheap: 1.5% of a step fits a 3% budget every step
    (1.0, 0.02, 0.03, 1),        # exactly the budget (0.02 * 1.5 = 0.03)
    (1.0, 0.021, 0.03, 2),       # just over: every other step
    (0.1, 0.5, 0.03, 250),       # expensive: 0.75 s / (0.03 * 0.1 s) = 250
    (0.2, 0.05, 0.10, 4),        # a looser budget: 0.075 / 0.02 = 3.75 -> 4
])
def test_auto_picks_the_most_frequent_interval_within_budget(step_s: float, cost_s: float,
                                                             budget: float, want: int) -> None:
    assert auto(step_s, cost_s, budget).interval == want


def test_auto_interval_is_capped() -> None:
    assert auto(0.001, 100.0).interval == AUTO_MAX_INTERVAL
    assert auto(1e-9, 1e9, 1e-6).interval == AUTO_MAX_INTERVAL


@settings(max_examples=300, deadline=None)
@given(step_s=st.floats(1e-4, 10.0), cost_s=st.floats(1e-6, 100.0),
       budget=st.floats(1e-3, 1.0))
def test_auto_respects_the_budget_and_its_bounds(step_s: float, cost_s: float,
                                                 budget: float) -> None:
    interval = auto(step_s, cost_s, budget).interval
    assert isinstance(interval, int) and 1 <= interval <= AUTO_MAX_INTERVAL
    cost_s *= UNSEEN_COST
    overhead = cost_s / (interval * step_s)
    if interval < AUTO_MAX_INTERVAL:             # uncapped: within budget (float rounding aside)
        assert overhead <= budget * (1 + 1e-9)
    else:                                        # capped only when the budget needs more
        assert cost_s / ((AUTO_MAX_INTERVAL - 1) * step_s) > budget * (1 - 1e-9)
    if interval > 1:                             # and the most frequent such interval
        assert cost_s / ((interval - 1) * step_s) > budget * (1 - 1e-9)


def test_auto_follows_changing_costs_through_its_averages() -> None:
    control = auto(0.1, 0.5)
    assert control.interval == 250
    for _ in range(60):                          # snapshots got cheap (smaller state)
        control.observe_work(0.0015)
    assert control.interval == 1
    for _ in range(80):                          # steps got much faster
        control.observe_step(0.001)
    assert control.interval == math.ceil(0.0015 * UNSEEN_COST / (0.03 * 0.001)) == 75


def test_snapshotter_due_counts_from_the_last_capture() -> None:
    no_keeper: Any = None                                   # due() never calls the keeper
    snapshotter = Snapshotter(no_keeper, job="j", rank=0, generation=0, secret=None,
                              policy=SnapshotPolicy("auto", 0.03), checksum_workers=1)
    try:
        snapshotter.observe_step(5.0)                      # the first step: not counted
        snapshotter.observe_step(0.1)
        snapshotter._control.observe_work(0.008)          # 0.008 * 1.5 / (0.03 * 0.1) = 4
        snapshotter.rewind(10)
        assert [s for s in range(10, 20) if snapshotter.due(s)] == list(range(14, 20))
    finally:
        snapshotter.close()


def test_a_tier_window_without_a_capture_makes_its_first_step_due() -> None:
    """With a long auto interval (here 40) and tiers every 10 and 25 steps, every tier
    window still gets the snapshot at its first step; steps in between wait for the
    interval. The rule reads only steps, so every rank picks the same ones."""
    no_keeper: Any = None
    snapshotter = Snapshotter(no_keeper, job="j", rank=0, generation=0, secret=None,
                              policy=SnapshotPolicy("auto", 0.03, windows=(10, 25)),
                              checksum_workers=1)
    try:
        snapshotter.observe_step(5.0)                      # the first step: not counted
        snapshotter.observe_step(0.01)
        snapshotter._control.observe_work(0.0079)      # 0.0079 * 1.5 / (0.03 * 0.01) -> 40
        assert snapshotter.interval == 40
        snapshotter.rewind(3)
        taken = []
        for step in range(4, 101):
            if snapshotter.due(step):
                taken.append(step)
                snapshotter.rewind(step)                  # as a capture at ``step`` counts
        assert taken == [10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 100]
    finally:
        snapshotter.close()


def steady(control: _IntervalController, step_s: float, steps: int = 20) -> None:
    for _ in range(steps):
        control.observe_step(step_s)


def test_auto_plans_with_what_the_steps_after_a_capture_felt() -> None:
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    steady(control, 0.010)
    control.observe_work(0.002)                  # the snapshot's threads: 2 ms
    assert control.interval == math.ceil(0.002 * UNSEEN_COST / (0.03 * 0.010))  # ~10
    control.observe_capture(0.001)               # but the loop felt 1 + 8 + 3 = 12 ms
    control.observe_step(0.018)
    control.observe_step(0.013)
    assert control.cost_s == pytest.approx(0.012)
    felt = math.ceil(control.cost_s * UNSEEN_COST / (0.03 * 0.010))
    assert 60 <= felt <= 61 and control.interval == felt
    steady(control, 0.010)                       # steps outside the window are plain steps
    assert control.interval == felt


def test_the_steps_after_a_capture_do_not_count_as_plain_steps() -> None:
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    steady(control, 0.010)
    control.observe_work(0.003)
    for _ in range(30):                          # every capture's window: slow steps
        control.observe_capture(0.0)
        control.observe_step(0.030)
        control.observe_step(0.030)
        steady(control, 0.010, 3)
    # the plain step stays 10 ms (an average over all steps would be 18 ms), and the felt
    # cost is the 40 ms the two slow steps added
    assert control.cost_s == pytest.approx(0.040)
    assert 200 <= control.interval <= 201


def test_a_window_cut_short_by_the_next_capture_is_not_measured() -> None:
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    steady(control, 0.010)
    control.observe_work(0.001)
    for _ in range(10):                          # interval 1: a capture after every step
        control.observe_capture(0.0)
        control.observe_step(0.050)
    assert control.cost_s == pytest.approx(0.001)  # only the threads' work is known
    control.observe_capture(None)                # a first capture (slot allocation): no window
    control.observe_step(0.500)
    control.observe_step(0.500)
    assert control.cost_s == pytest.approx(0.001)


def test_a_faster_than_plain_window_costs_nothing_rather_than_less() -> None:
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    steady(control, 0.010)
    control.observe_work(0.0005)
    control.observe_capture(0.0)
    control.observe_step(0.004)
    control.observe_step(0.004)
    assert control.cost_s == pytest.approx(0.0005)


def test_step_time_noise_alone_is_no_cost() -> None:
    """Windows after captures that are as often 20 ms slower as 20 ms faster than a plain
    step (noise on a loaded machine) average to no felt cost: the interval stays 1 for a
    cheap snapshot. Clipping each window at 0 before averaging made the noise a cost of
    ~10 ms and the interval ~8."""
    control = _IntervalController(SnapshotPolicy("auto", 0.03))
    steady(control, 0.060)
    control.observe_work(0.0004)
    for sign in (1, -1) * 10:
        control.observe_capture(0.0004)
        control.observe_step(0.060 + sign * 0.010)
        control.observe_step(0.060 + sign * 0.010)
    assert control.cost_s < 0.001
    assert control.interval == 1


def test_start_up_steps_do_not_shorten_the_interval() -> None:
    """The bench transformer's start as its logs show it: step 0 (lazy allocations, DDP's
    first bucket rebuild) took 1.75 s, the steps in the measuring capture's window 1.65 s
    and 0.60 s, plain steps 0.21 s, the capture's threads 0.93 s. Planned with step 0 the
    interval was 28 (an extra full snapshot a few seconds in); now the first step of the
    process is not counted, nothing is planned before a plain step was measured, and the
    interval is what the steady state asks for. A restore makes the next step cold again."""
    no_keeper: Any = None
    snapshotter = Snapshotter(no_keeper, job="j", rank=0, generation=0, secret=None,
                              policy=SnapshotPolicy("auto", 0.03), checksum_workers=1)
    control = snapshotter._control
    try:
        snapshotter.observe_step(1.75)
        control.observe_capture(0.02)                      # the measuring capture
        control.observe_work(0.93)
        snapshotter.observe_step(1.65)
        snapshotter.observe_step(0.60)
        assert not control.measured and snapshotter.wanted_interval == 0
        for _ in range(3):
            snapshotter.observe_step(0.21)
        steady_interval = math.ceil(0.93 * UNSEEN_COST / (0.03 * 0.21))
        assert snapshotter.wanted_interval == steady_interval == 222
        snapshotter.rewind(40)                             # a restore: the next step is cold
        snapshotter.observe_step(3.0)
        assert snapshotter.wanted_interval == steady_interval
    finally:
        snapshotter.close()
