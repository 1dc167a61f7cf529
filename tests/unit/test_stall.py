"""Stall detection against observed step times and declared work: a healthy step longer
than ``stall_timeout_s``, work outside ``session.step()`` and ``session.busy()`` are no
hang; a real hang (no progress inside a step) is still found at ``stall_timeout_s``."""
from __future__ import annotations

import time

import pytest
import torch

from phalanx.launcher.coordination.coordinator import RankSlot
from phalanx.launcher.coordination.monitor import Monitor
from phalanx.recovery.base import FaultKind
from phalanx.recovery.detection import (RECENT_STEPS, STALL_STEP_FACTOR, Progress,
                                        StallDetector)
from phalanx.runtime.base import MemberRecord, Rank, Step
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.worker.activity import Activity
from phalanx.runtime.worker.session import Session

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def feed(detector: StallDetector, rank: int, step: int, at: float, *, in_step: bool = True,
         busy: bool = False, step_s: float = 0.0) -> None:
    detector.observe(Progress(Rank(rank), Step(step), at, in_step, busy, step_s))


def stalled(detector: StallDetector, now: float) -> list[tuple[int, ...]]:
    reports = detector.check(now)
    assert all(r.kind is FaultKind.STALLED for r in reports)
    return [r.ranks for r in reports]


# --- observed step times ------------------------------------------------------------------


def test_a_6_s_step_with_a_5_s_timeout_is_no_stall_once_a_step_time_was_seen() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    for step in range(1, 5):                      # 6 s steps, both ranks
        for rank in range(2):
            feed(detector, rank, step, 6.0 * step, step_s=6.0)
        assert stalled(detector, 6.0 * step + 5.999) == []
        assert stalled(detector, 6.0 * step + 6.0) == []   # mid next step: still healthy
    assert detector.threshold_s() == STALL_STEP_FACTOR * 6.0
    assert stalled(detector, 24.0 + 18.0) == [(0,), (1,)]  # 3 step times: hung after all


def test_a_real_hang_with_short_steps_is_reported_at_the_timeout() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    for step in range(1, 40):                     # 50 ms steps
        feed(detector, 0, step, step / 20, step_s=0.05)
        feed(detector, 1, step, step / 20, step_s=0.05)
    feed(detector, 1, 40, 2.0, step_s=0.05)       # rank 1 froze inside step 40
    feed(detector, 0, 41, 2.05, step_s=0.05)      # rank 0 waits in step 41's all-reduce
    assert detector.threshold_s() == 5.0
    assert stalled(detector, 6.999) == []
    reports = detector.check(7.0)
    assert [r.ranks for r in reports] == [(1,)]
    assert reports[0].observed_at == 7.0
    assert "threshold 5.000 s" in reports[0].evidence


def test_the_threshold_is_the_factor_times_the_longest_recent_step() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    feed(detector, 0, 1, 0.0, step_s=1.0)
    assert detector.threshold_s() == 5.0           # 3 x 1 s is below the timeout
    feed(detector, 1, 1, 0.0, step_s=4.0)          # the longest across ranks counts
    assert detector.threshold_s() == STALL_STEP_FACTOR * 4.0
    feed(detector, 1, 1, 0.5, step_s=9.0)          # the same step again adds nothing
    assert detector.threshold_s() == STALL_STEP_FACTOR * 4.0
    for step in range(2, 2 + RECENT_STEPS):        # the slow step ages out of the window
        feed(detector, 0, step, float(step), step_s=1.0)
    assert detector.threshold_s() == 5.0


def test_reset_forgets_the_observed_step_times() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    feed(detector, 0, 1, 0.0, step_s=30.0)
    assert detector.threshold_s() == 90.0
    detector.reset()
    assert detector.threshold_s() == 5.0
    feed(detector, 0, 3, 100.0)
    assert stalled(detector, 105.0) == [(0,)]


# --- work outside a step, busy ------------------------------------------------------------


def test_a_rank_outside_a_step_or_busy_is_never_reported() -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 4, 0.0, in_step=False)       # evaluating after step 3
    feed(detector, 1, 4, 0.0, busy=True)           # saving, declared
    assert stalled(detector, 1000.0) == []


def test_ranks_waiting_for_an_excused_laggard_are_not_reported() -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 4, 0.0, in_step=False)       # rank 0 evaluates
    feed(detector, 1, 4, 0.0)                      # rank 1 waits in step 4's all-reduce
    feed(detector, 2, 5, 0.0)                      # stale by a beat: ahead
    assert stalled(detector, 60.0) == []


def test_the_timer_restarts_when_an_excused_rank_steps_again() -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 4, 0.0)
    feed(detector, 0, 4, 0.5, in_step=False)       # 30 s of evaluation
    feed(detector, 0, 4, 30.0)                     # back in step 4
    assert stalled(detector, 30.999) == []
    assert stalled(detector, 31.0) == [(0,)]       # and hung inside it


def test_a_wait_for_an_excused_rank_counts_only_from_when_it_steps_again() -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 4, 0.0, in_step=False)       # rank 0 evaluates for 3 s
    feed(detector, 1, 4, 0.0)                      # rank 1 waits in step 4's all-reduce
    feed(detector, 0, 6, 3.0, busy=True)           # rank 0 stepped on (and is busy again)
    assert stalled(detector, 3.5) == []            # rank 1's record is a beat late
    feed(detector, 1, 6, 3.6, busy=True)
    assert stalled(detector, 60.0) == []


def test_a_rank_hung_while_another_was_excused_is_reported_a_timeout_after_it_resumed(
        ) -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 4, 0.0, in_step=False)
    feed(detector, 1, 4, 0.0)                      # hung, not waiting
    feed(detector, 0, 5, 3.0)                      # rank 0 waits for rank 1 in step 5
    assert stalled(detector, 3.999) == []
    assert stalled(detector, 4.0) == [(1,)]


def test_an_excused_rank_ahead_does_not_hide_a_laggard() -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 9, 0.0, in_step=False)
    feed(detector, 1, 7, 0.0)
    assert stalled(detector, 1.0) == [(1,)]


# --- what the worker publishes and the launcher reads -------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_activity_publishes_in_step_after_a_grace_and_busy_at_once() -> None:
    clock, wakes = Clock(), []
    activity = Activity(0.25, lambda: wakes.append(1), clock)
    assert activity.extra()["in_step"] is True     # nothing run yet: judged as stepping
    activity.enter_step()
    activity.leave_step(6.0)
    clock.now += 0.2                               # between two steps
    assert activity.extra()["in_step"] is True
    clock.now += 0.1                               # an evaluation pass
    extra = activity.extra()
    assert (extra["in_step"], extra["step_s"], extra["busy"]) == (False, 6.0, None)
    activity.enter_step()
    with activity.busy("evaluation"):
        assert activity.extra()["busy"] == "evaluation" and wakes == [1]
        with activity.busy("save"):
            assert activity.extra()["busy"] == "save"
        assert activity.extra()["busy"] == "evaluation"
    assert activity.extra()["busy"] is None and activity.extra()["in_step"] is True
    activity.leave_step(None)                      # rolled back: no step time
    assert activity.extra()["step_s"] == 6.0


def test_session_publishes_step_time_in_step_and_busy() -> None:
    ctx = WorkerContext(job="stall", rank=0, world_size=1, heartbeat_s=0.2,
                        torch_threads=torch.get_num_threads())
    session = Session(ctx, capture_rng=False)
    with session:
        with session.step():
            assert session._record().extra["in_step"] is True
            time.sleep(0.05)
        extra = session._record().extra
        assert extra["step_s"] >= 0.05 and extra["left_step_at"] > 0
        time.sleep(0.15)                           # past the grace (heartbeat_s / 2)
        assert session._record().extra["in_step"] is False
        with session.busy("evaluation"):
            assert session._record().extra["busy"] == "evaluation"
        with session.busy():
            assert session._record().extra["busy"] == "busy"
        assert session._beat_state() != ()


class SlowTeardown:
    """A collective whose abandoned groups take a while to tear down (a powered-off peer);
    records what the rank's heartbeat would publish meanwhile."""

    absorb_faults = True

    def __init__(self, session: Session) -> None:
        self.session = session
        self.seen: tuple = ()

    def wait_released(self, timeout_s: float) -> bool:
        record = self.session._record()
        self.seen = (record.step, record.extra["busy"], self.session._stop.is_set())
        return True


def test_a_finishing_rank_publishes_its_last_step_as_busy_while_groups_tear_down() -> None:
    ctx = WorkerContext(job="stall", rank=0, world_size=1, heartbeat_s=0.2,
                        torch_threads=torch.get_num_threads())
    session = Session(ctx, capture_rng=False)
    with session:
        for _ in range(3):
            with session.step():
                pass
        teardown = SlowTeardown(session)
        session._collective = teardown      # type: ignore[assignment]
    # the heartbeat still runs and says "finishing" at the final step: no stall is seen
    assert teardown.seen == (3, "finishing", False)


def test_the_monitor_reads_the_published_fields_into_progress() -> None:
    record = MemberRecord(worker_id="w0", rank=0, node="node0", step=7, extra={
        "state": "running", "in_step": False, "busy": "evaluation", "step_s": 6.5})
    old = MemberRecord(worker_id="w1", rank=1, node="node0", step=7, extra={})
    monitor = Monitor(2, node_check_s=1e9)
    slots = {r: RankSlot(r, f"w{r}", 0, None) for r in range(2)}
    progress = monitor.poll(slots, set(), {"w0": record, "w1": old}, timeout_s=0).progress
    by_rank = {p.rank: (p.in_step, p.busy, p.step_s) for p in progress}
    assert by_rank == {0: (False, True, 6.5), 1: (True, False, 0.0)}
