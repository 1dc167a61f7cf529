"""``spares.on_exhausted: wait``: a recovery with no warm spare is parked (phase degraded,
an event), the same fault seen again at the next poll does not re-plan it, and past
``spares.wait_timeout_s`` the job fails naming what it waited for."""
from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.configs.errors import PlanInfeasible
from phalanx.configs.loader import load_config
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.events import EventLog, read_events
from phalanx.recovery.base import FaultKind, FaultReport
from phalanx.recovery.phases import Phase
from phalanx.runtime.keeper.reporter import report_from_keeper
from tests.fakes.membership_memory import InMemoryMembership

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def coordinator(tmp_path: Path, clock: Clock) -> RecoveryCoordinator:
    cfg = load_config("configs/demo.yaml", ["spares.on_exhausted=wait", "spares.count=0",
                                            "spares.wait_timeout_s=30", "tiers.disk.enabled=false",
                                            "job.world_size=2"])
    events = EventLog(tmp_path / "events.jsonl")
    launched: list[RankSlot] = []
    coord = RecoveryCoordinator(cfg, InMemoryMembership(), {}, None,
                                lambda slot, gen, restore: launched.append(slot), events,
                                str(tmp_path), clock=clock)
    coord.committed = lambda: 7
    # both keepers are alive and hold step 7 of their ranks: a restore is possible
    coord._fresh_reports = lambda: {  # type: ignore[method-assign]
        f"node{n}": report_from_keeper(f"node{n}", ("127.0.0.1", 1), {n: {"local": [7]}}, {}, 0)
        for n in (0, 1)}
    return coord


def test_no_spare_parks_the_recovery_then_fails_at_the_deadline(tmp_path: Path) -> None:
    clock = Clock()
    coord = coordinator(tmp_path, clock)
    slots = {r: RankSlot(r, f"w{r}-g0", r % 2, None) for r in range(2)}
    died = FaultReport(FaultKind.WORKER_DIED, (1,), "node1", clock(), "actor died")
    coord.recover([died], slots)
    assert coord.phases.phase is Phase.DEGRADED and coord.waiting is not None
    seen_again = FaultReport(FaultKind.WORKER_DIED, (1,), "node1", clock() + 1, "again")
    its_lease = FaultReport(FaultKind.LEASE_LOST, (1,), "node1", clock() + 3, "lease lapsed")
    assert coord.fresh([seen_again, its_lease]) == []
    other = FaultReport(FaultKind.WORKER_DIED, (0,), "node0", clock() + 1, "another")
    assert coord.fresh([seen_again, other]) == [other]
    clock.now += 10
    coord.retry(slots)                          # no spare yet: still parked
    assert coord.phases.phase is Phase.DEGRADED
    clock.now += 25
    with pytest.raises(PlanInfeasible, match=r"rank\(s\) \[1\].*wait_timeout_s=30"):
        coord.retry(slots)
    assert coord.phases.phase is Phase.FAILED
    names = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert "waiting_for_capacity" in names
    assert [e["to"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "phase"] \
        == ["detecting", "planning", "degraded", "failed"]
