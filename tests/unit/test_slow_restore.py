"""A restore slower than ``recovery.group_timeout_s`` (issue 17, item 5) and a resumed run's
restart before its first commit (items 1/6), with the in-memory membership and a fake
clock: a rank that still reports its restore is waited for up to ``restore_bound_s``, then
named; a rank whose reports stopped fails at the usual bound; the ranks of a generation
wait for each other's restores before forming their group; and a resumed run that loses a
rank with nothing committed restarts every rank from the resume checkpoint."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from phalanx.launcher.coordination.bounds import GroupNotReformed
from phalanx.runtime.worker.restore_progress import (RESTORED, RESTORING, RestoreReport,
                                                     restore_bound_s, restore_key, wait_restored)
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore
from tests.unit.test_coordinator_fencing import BUDGET_S, fenced
from tests.unit.test_recovery_bounds import BOUND_S, events, record

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture(autouse=True)
def no_ray_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)


def report(membership: InMemoryMembership, generation: int, rank: int, worker: str,
           state: str = RESTORING, age_s: float = 0.0) -> None:
    now = time.time()
    membership.put(restore_key(generation, rank),
                   RestoreReport(worker, state, now - 60, now - age_s).encode())


def test_a_rank_still_restoring_is_waited_for_up_to_the_restore_bound(
        tmp_path: Path) -> None:
    membership = InMemoryMembership(InMemoryStore())
    job = fenced(tmp_path, membership)
    job.kill_rank(1)
    members = {"w0-g0": record("w0-g0", 0, 1)}          # rank 0 restored and waits
    report(membership, 1, 1, "w1-g1")
    job.clock.now += BOUND_S + 5
    job.coord.check_rejoined(members, set())            # past the rejoin bound: waited for
    job.clock.now += 10
    report(membership, 1, 1, "w1-g1")
    job.coord.check_rejoined(members, set())
    [slow] = events(tmp_path, "restore_slow")
    assert slow["ranks"] == {"1": 60.0} and slow["bound_s"] == restore_bound_s(BUDGET_S)
    job.clock.now = 100 + restore_bound_s(BUDGET_S) + 0.1   # the plan was at 100
    report(membership, 1, 1, "w1-g1")
    with pytest.raises(GroupNotReformed, match=rf"within {restore_bound_s(BUDGET_S):g} s.*"
                       r"rank 1 \(worker w1-g1\) never joined"):
        job.coord.check_rejoined(members, set())


def test_a_restore_whose_reports_stopped_fails_at_the_rejoin_bound(tmp_path: Path) -> None:
    membership = InMemoryMembership(InMemoryStore())
    job = fenced(tmp_path, membership)
    job.kill_rank(1)
    report(membership, 1, 1, "w1-g1", age_s=30)         # its reports stopped 30 s ago
    job.clock.now += BOUND_S + 0.1
    with pytest.raises(GroupNotReformed, match=rf"within {BOUND_S:g} s"):
        job.coord.check_rejoined({"w0-g0": record("w0-g0", 0, 1)}, set())
    assert events(tmp_path, "restore_slow") == []


def test_ranks_wait_for_each_others_restores_before_forming() -> None:
    membership = InMemoryMembership(InMemoryStore())
    report(membership, 3, 1, "spare-1")
    polls: list[int] = []

    def sleep(seconds: float) -> None:       # rank 1 reports twice, then has restored
        polls.append(1)
        report(membership, 3, 1, "spare-1", RESTORED if len(polls) >= 3 else RESTORING)

    missing = wait_restored(membership, 3, 2, 0, group_timeout_s=1.0, heartbeat_s=0.1,
                            should_abort=lambda: False, sleep=sleep)
    assert missing == [] and len(polls) == 3
    report(membership, 4, 1, "spare-1", age_s=30)       # stopped reporting: not waited for
    assert wait_restored(membership, 4, 2, 0, group_timeout_s=1.0, heartbeat_s=0.1,
                         should_abort=lambda: False, sleep=sleep) == [1]


def test_a_resumed_run_restarted_with_nothing_committed_restores_the_resume_point(
        tmp_path: Path) -> None:
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()), committed=-1)
    resume: dict[str, Any] = {"step": 40, "sources": [{"kind": "tier", "tier": "disk",
                                                        "path": "/ckpt"}]}
    job.coord.resumed_from = (resume, "demo-20261201-000000-abcd")
    job.kill_rank(1)
    assert sorted(r for r, _, _, _ in job.launched) == [0, 1]      # every rank restarts
    assert all(restore == {**resume, "joins_survivors": False}
               for _, _, _, restore in job.launched), job.launched
    [restart] = events(tmp_path, "restart_from_resume")
    assert restart["step"] == 40 and restart["run_id"] == "demo-20261201-000000-abcd"
    assert job.coord.pending is not None and job.coord.pending.restore_step == 40
