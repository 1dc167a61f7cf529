"""Fault detection on a manual clock: classification, grouping, dedupe, root cause, stalls."""
from __future__ import annotations

import pytest

from phalanx.configs.schema import DetectionConfig
from phalanx.recovery.base import FaultKind, FaultReport, WorldView
from phalanx.recovery.detection import (ActorDied, CollectiveError, KeeperLeaseExpired, LeaseLost,
                                        NodeLost, Progress, StallDetector, WorkerRaised, classify,
                                        root_cause)
from phalanx.runtime.base import Generation, NodeId, Rank, Step, WorkerId

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

POLL_S = DetectionConfig().poll_interval_s


def make_world(nodes: int = 3, per_node: int = 2, dead: tuple[str, ...] = ()) -> WorldView:
    """Ranks 2k, 2k+1 on node n<k>; worker of rank r is w<r>-g0."""
    ranks = range(nodes * per_node)
    return WorldView(
        generation=Generation(0), world_size=len(ranks),
        rank_workers={Rank(r): WorkerId(f"w{r}-g0") for r in ranks},
        worker_nodes={WorkerId(f"w{r}-g0"): NodeId(f"n{r // per_node}") for r in ranks},
        live_nodes=frozenset(NodeId(f"n{k}") for k in range(nodes) if f"n{k}" not in dead),
        committed_step=Step(10))


WORLD = make_world()


def kinds(reports: list[FaultReport]) -> list[tuple[FaultKind, tuple[int, ...], str | None]]:
    return [(r.kind, r.ranks, r.node) for r in reports]


# --- classification ---------------------------------------------------------------------


def test_worker_death_is_reported_within_one_poll() -> None:
    died_at = 5.0
    reports = classify([ActorDied(WorkerId("w3-g0"), died_at, "SIGKILL")], WORLD,
                       now=died_at + POLL_S)
    assert kinds(reports) == [(FaultKind.WORKER_DIED, (3,), "n1")]
    assert reports[0].observed_at == died_at
    assert "w3-g0" in reports[0].evidence and "SIGKILL" in reports[0].evidence


def test_node_death_groups_its_ranks_and_absorbs_their_deaths() -> None:
    signals = [ActorDied(WorkerId("w2-g0"), 4.9), NodeLost(NodeId("n1"), 5.0),
               ActorDied(WorkerId("w3-g0"), 5.05), LeaseLost(WorkerId("w3-g0"), 5.2)]
    reports = classify(signals, make_world(dead=("n1",)), now=5.3)
    assert kinds(reports) == [(FaultKind.NODE_DIED, (2, 3), "n1")]
    assert reports[0].observed_at == 4.9  # the first sign of the node's death


def test_worker_death_on_a_node_no_longer_live_is_a_node_death() -> None:
    reports = classify([ActorDied(WorkerId("w4-g0"), 7.0)], make_world(dead=("n2",)), now=7.1)
    assert kinds(reports) == [(FaultKind.NODE_DIED, (4, 5), "n2")]


@pytest.mark.parametrize(("dead", "extra", "kind"), [
    pytest.param(("n1",), [], FaultKind.NODE_DIED, id="node-not-live"),
    pytest.param((), [], FaultKind.KEEPER_DIED, id="keeper-only"),
    pytest.param((), [LeaseLost(WorkerId("w2-g0"), 3.2)], FaultKind.PARTITIONED,
                 id="keeper-and-members"),
])
def test_keeper_lease_expiry(dead: tuple[str, ...], extra: list[LeaseLost],
                             kind: FaultKind) -> None:
    signals = [KeeperLeaseExpired(NodeId("n1"), 3.0), *extra]
    reports = classify(signals, make_world(dead=dead), now=3.5)
    assert kinds(reports) == [(kind, (2, 3), "n1")]


def test_collective_error_is_a_consequence_when_a_death_explains_it() -> None:
    # The survivor's gloo reset arrives before Ray reports the death: still a consequence.
    signals = [CollectiveError(Rank(0), 4.95, "Connection reset by peer"),
               ActorDied(WorkerId("w3-g0"), 5.0)]
    reports = classify(signals, WORLD, now=5.1)
    assert kinds(reports) == [(FaultKind.COLLECTIVE_ERROR, (0,), "n0"),
                              (FaultKind.WORKER_DIED, (3,), "n1")]
    assert root_cause(reports).kind is FaultKind.WORKER_DIED


def test_collective_error_alone_is_its_own_root_cause() -> None:
    signals = [CollectiveError(Rank(4), 6.0, "timeout"), CollectiveError(Rank(1), 5.5, "x")]
    reports = classify(signals, WORLD, now=6.1)
    cause = root_cause(reports)
    assert (cause.kind, cause.ranks) == (FaultKind.COLLECTIVE_ERROR, (1,))


def test_root_cause_is_the_earliest_and_needs_a_report() -> None:
    signals = [ActorDied(WorkerId("w5-g0"), 9.0), WorkerRaised(Rank(1), "Traceback\nBoom", 8.0)]
    cause = root_cause(classify(signals, WORLD, now=9.5))
    assert (cause.kind, cause.ranks, cause.evidence) == (
        FaultKind.WORKER_EXCEPTION, (1,), "Traceback\nBoom")
    with pytest.raises(ValueError):
        root_cause([])


def test_repeated_signals_collapse_to_one_report_at_the_earliest_time() -> None:
    signals = [ActorDied(WorkerId("w1-g0"), 2.0), ActorDied(WorkerId("w1-g0"), 1.5),
               ActorDied(WorkerId("w1-g0"), 2.5), NodeLost(NodeId("n2"), 3.0),
               NodeLost(NodeId("n2"), 2.8)]
    reports = classify(signals, make_world(dead=("n2",)), now=3.0)
    assert kinds(reports) == [(FaultKind.WORKER_DIED, (1,), "n0"),
                              (FaultKind.NODE_DIED, (4, 5), "n2")]
    assert [r.observed_at for r in reports] == [1.5, 2.8]


def test_signals_outside_the_world_and_progress_are_ignored() -> None:
    signals = [ActorDied(WorkerId("spare-7"), 1.0), ActorDied(WorkerId("w1-g-old"), 1.0),
               CollectiveError(Rank(99), 1.0), Progress(Rank(0), Step(3), 1.0)]
    assert classify(signals, WORLD, now=2.0) == []


def test_a_signal_stamped_in_the_future_counts_as_observed_now() -> None:
    reports = classify([ActorDied(WorkerId("w0-g0"), 12.0)], WORLD, now=10.0)
    assert reports[0].observed_at == 10.0


def test_reports_are_sorted_and_deterministic() -> None:
    signals = [ActorDied(WorkerId("w5-g0"), 3.0), ActorDied(WorkerId("w0-g0"), 3.0),
               WorkerRaised(Rank(2), "E", 1.0)]
    first = classify(signals, WORLD, now=4.0)
    assert first == classify(list(reversed(signals)), WORLD, now=4.0)
    assert [r.ranks for r in first] == [(2,), (0,), (5,)]


# --- stalls -------------------------------------------------------------------------------


def feed(detector: StallDetector, rank: int, step: int, at: float) -> None:
    detector.observe(Progress(Rank(rank), Step(step), at))


def test_stall_is_reported_at_exactly_the_timeout_and_not_before() -> None:
    detector = StallDetector(stall_timeout_s=10.0)
    feed(detector, 0, 5, 100.0)
    feed(detector, 1, 5, 100.0)
    for i in range(1, 10):  # rank 0 keeps advancing; rank 1 is stuck at step 5
        feed(detector, 0, 5 + i, 100.0 + i)
    assert detector.check(now=109.999) == []
    reports = detector.check(now=110.0)
    assert kinds(reports) == [(FaultKind.STALLED, (1,), None)]
    assert reports[0].observed_at == 110.0
    assert "step 5" in reports[0].evidence


def test_progress_resets_the_stall_timer() -> None:
    detector = StallDetector(stall_timeout_s=10.0)
    feed(detector, 0, 5, 100.0)
    feed(detector, 1, 5, 100.0)
    feed(detector, 0, 6, 101.0)
    feed(detector, 1, 6, 105.0)  # rank 1 advanced: its timer restarts
    feed(detector, 0, 7, 106.0)
    assert detector.check(now=110.0) == []
    assert detector.check(now=114.999) == []
    assert kinds(detector.check(now=115.0)) == [(FaultKind.STALLED, (1,), None)]


def test_the_same_step_again_does_not_reset_the_timer() -> None:
    detector = StallDetector(stall_timeout_s=2.0)
    feed(detector, 0, 3, 0.0)
    feed(detector, 1, 4, 0.0)
    feed(detector, 0, 3, 1.5)  # a heartbeat carrying no new step
    feed(detector, 1, 5, 1.5)
    assert kinds(detector.check(now=2.0)) == [(FaultKind.STALLED, (0,), None)]


def test_ranks_waiting_ahead_of_a_laggard_are_not_stalled() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    feed(detector, 0, 8, 100.0)  # waiting in the next collective for rank 1
    feed(detector, 1, 7, 95.0)
    feed(detector, 2, 8, 100.0)
    assert kinds(detector.check(now=120.0)) == [(FaultKind.STALLED, (1,), None)]


def test_a_job_wide_hang_reports_every_rank() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    for rank in range(3):
        feed(detector, rank, 4, 10.0 + rank)
    assert detector.check(now=14.999) == []
    assert [r.ranks for r in detector.check(now=16.0)] == [(0,), (1,)]  # rank 2 came at 12.0
    assert [r.ranks for r in detector.check(now=17.0)] == [(0,), (1,), (2,)]


def test_reordered_samples_are_ignored_and_a_rollback_restarts_the_timer() -> None:
    detector = StallDetector(stall_timeout_s=5.0)
    feed(detector, 0, 9, 50.0)
    feed(detector, 0, 8, 49.0)  # delivered late: older than the step we have
    assert kinds(detector.check(now=55.0)) == [(FaultKind.STALLED, (0,), None)]
    feed(detector, 0, 6, 56.0)  # rolled back to step 6 by a recovery
    assert detector.check(now=60.0) == []


def test_forget_reset_and_config() -> None:
    detector = StallDetector.from_config(DetectionConfig(stall_timeout_s=3.0))
    assert detector.stall_timeout_s == 3.0
    feed(detector, 0, 1, 0.0)
    feed(detector, 1, 1, 0.0)
    detector.forget(Rank(1))
    assert [r.ranks for r in detector.check(now=3.0)] == [(0,)]
    detector.reset()
    assert detector.check(now=100.0) == []
    with pytest.raises(ValueError):
        StallDetector(stall_timeout_s=0)


def test_stall_and_death_together_death_is_root_cause() -> None:
    detector = StallDetector(stall_timeout_s=1.0)
    feed(detector, 0, 3, 0.0)
    feed(detector, 1, 4, 0.5)
    reports = classify([CollectiveError(Rank(1), 0.9, "timeout")], WORLD, now=1.0)
    cause = root_cause(reports + detector.check(now=1.0))
    assert (cause.kind, cause.ranks) == (FaultKind.STALLED, (0,))
