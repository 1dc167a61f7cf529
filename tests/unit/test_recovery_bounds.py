"""No hidden deadlines (issue 17, item 5), with the in-memory membership and a fake clock:
a new generation some rank never joins (a spare still restoring, a survivor outside
``session.step()``) fails the job naming those ranks at ``group_timeout_s`` + margin, not
after the workers' 120 s plan timeout; a joined generation whose first step is long is left
alone; a fault after some rank returned fails at once with ``FaultAfterFinish``; and a tier
whose S3 endpoint accepts connections and never answers cannot hold the plan (a real boto3
client against a black-hole socket)."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import ray

from phalanx.configs.loader import load_config
from phalanx.launcher.coordination.bounds import (FRESH_WORKER_START_S, FaultAfterFinish,
                                                  GroupNotReformed, REJOIN_MARGIN_S,
                                                  rejoin_bound_s, unfinished_faults)
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.coordination.retry import RecoveryStalled
from phalanx.launcher.events import EventLog
from phalanx.launcher.job import _after_finish
from phalanx.recovery.base import FaultKind, FaultReport
from phalanx.recovery.phases import Phase
from phalanx.runtime.base import MemberRecord, NodeId, Rank
from phalanx.runtime.worker.restore_progress import RESTORED, RestoreReport, restore_key
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore
from tests.unit.test_coordinator_fencing import BUDGET_S, fenced

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]
HEARTBEAT_S = 0.5        # etcd.heartbeat_s of demo.yaml
# these jobs have no spare: the lost rank restarts as a fresh worker process
BOUND_S = BUDGET_S + REJOIN_MARGIN_S + 2 * HEARTBEAT_S + FRESH_WORKER_START_S


@pytest.fixture(autouse=True)
def no_ray_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator kills a replaced rank's actor; these actors are strings."""
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)


def record(worker: str, rank: int, generation: int, step: int = 5, **extra: Any) -> MemberRecord:
    return MemberRecord(worker, rank, f"node{rank}", step=step, generation=generation,
                        extra=extra)


def events(tmp_path: Path, name: str) -> list[dict]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_generation_nobody_rejoined_fails_at_its_bound_naming_each_rank(
        tmp_path: Path) -> None:
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)                      # rank 1 restarts; rank 0 must re-form with it
    assert job.coord.pending is not None and job.coord.generation == 1
    # rank 0 sleeps outside session.step() in generation 0; rank 1's worker never joined
    members = {"w0-g0": record("w0-g0", 0, 0, in_step=False)}
    job.clock.now += BOUND_S - 0.1
    job.coord.check_rejoined(members, set())          # within the bound: still waiting
    job.clock.now += 0.2
    with pytest.raises(GroupNotReformed) as failed:
        job.coord.check_rejoined(members, set())
    message = str(failed.value)
    assert isinstance(failed.value, RecoveryStalled)
    assert f"within {BOUND_S:g} s" in message and f"group_timeout_s={BUDGET_S:g}" in message
    assert "rank 0 (worker w0-g0) was still in generation 0" in message
    assert "outside session.step()" in message
    assert "rank 1 (worker w1-g1) never joined" in message
    stalled = events(tmp_path, "recovery_stalled")
    assert len(stalled) == 1 and stalled[0]["generation"] == 1
    assert stalled[0]["bound_s"] == BOUND_S and set(stalled[0]["ranks"]) == {"0", "1"}
    assert job.coord.phases.phase is Phase.FAILED


def test_the_bound_allows_fresh_workers_to_start_only_when_the_plan_has_any() -> None:
    assert rejoin_bound_s(30, 0.5) == 30 + REJOIN_MARGIN_S + 1
    assert rejoin_bound_s(30, 0.5, fresh_workers=True) == 30 + REJOIN_MARGIN_S + 1 + 30


def test_a_group_that_failed_to_form_is_named_with_its_error(
        tmp_path: Path) -> None:
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    error = {"generation": 1, "detail": "generation 1's group did not form: timeout"}
    members = {"w0-g0": record("w0-g0", 0, 1, collective_error=error),
               "w1-g1": record("w1-g1", 1, 1)}
    job.clock.now += BOUND_S + 0.1
    with pytest.raises(GroupNotReformed, match=r"rank 0 \(worker w0-g0\) saw generation 1's "
                       r"group fail to form: generation 1's group did not form: timeout"):
        job.coord.check_rejoined(members, set())


def test_a_joined_generation_with_a_long_first_step_is_not_failed(
        tmp_path: Path) -> None:
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    members = {"w0-g0": record("w0-g0", 0, 1, in_step=True),
               "w1-g1": record("w1-g1", 1, 1, in_step=True)}
    job.clock.now += 10 * BOUND_S             # a 30 s step is the stall detector's to judge
    job.coord.check_rejoined(members, set())
    assert job.coord.pending is not None and events(tmp_path, "recovery_stalled") == []


def test_a_rank_of_the_new_generation_that_returned_fails_it_at_once(
        tmp_path: Path) -> None:
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    members = {"w1-g1": record("w1-g1", 1, 1)}
    with pytest.raises(GroupNotReformed, match="rank 0 .* had returned from its entrypoint"):
        job.coord.check_rejoined(members, {0})


def test_a_generation_every_rank_joined_and_then_returned_completes_the_recovery(
        tmp_path: Path) -> None:
    """A fault after the last step (a rank killed in the evaluation after the last epoch):
    the ranks join the new generation, run that evaluation again together and return
    without another step. Their records left etcd as they returned; their last records seen
    say they joined: the recovery is complete, not a generation they failed to re-form.
    One returned from an older generation still fails the job."""
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    seen = {"w0-g0": record("w0-g0", 0, 1, step=48), "w1-g1": record("w1-g1", 1, 1, step=48)}
    job.coord.check_rejoined({}, {0, 1}, seen)
    assert job.coord.pending is None and events(tmp_path, "recovery_stalled") == []
    [recovered] = events(tmp_path, "recovered")
    assert recovered["generation"] == 1 and recovered["lost_steps"] == 0
    seen["w0-g0"] = record("w0-g0", 0, 0, step=48)
    # the last record seen is of generation 0, but rank 0 reported its restore (its heal)
    # in generation 1: it joined, and returned before a record of it was seen
    membership = InMemoryMembership(InMemoryStore())
    job = fenced(tmp_path / "reported", membership)
    job.kill_rank(1)
    membership.put(restore_key(1, 0), RestoreReport("w0-g0", RESTORED, 1.0, 2.0).encode())
    job.coord.check_rejoined({}, {0, 1}, seen)
    assert job.coord.pending is None
    job = fenced(tmp_path / "older", InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    with pytest.raises(GroupNotReformed, match="rank 0 .* had returned from its entrypoint"):
        job.coord.check_rejoined({}, {0, 1}, seen)


def fault(kind: FaultKind, *ranks: int, node: str | None = None) -> FaultReport:
    return FaultReport(kind, tuple(Rank(r) for r in ranks), NodeId(node) if node else None,
                       1.0, f"{kind.value} seen")


def test_a_fault_after_a_rank_finished_fails_at_once_naming_both() -> None:
    slots = {r: RankSlot(r, f"w{r}", r % 2, None) for r in range(3)}
    with pytest.raises(FaultAfterFinish) as failed:
        _after_finish([fault(FaultKind.WORKER_DIED, 2)], {0: {"loss": 0.1}}, slots,
                      {"w0": 60}.get)
    message = str(failed.value)
    assert "rank(s) [2]" in message and "rank(s) 0 (step 60) had returned" in message
    assert "--resume latest" in message


def test_faults_about_finished_ranks_only_are_dropped() -> None:
    slots = {r: RankSlot(r, f"w{r}", r % 2, None) for r in range(2)}
    node0 = fault(FaultKind.NODE_DIED, 0, node="node0")
    assert _after_finish([node0], {0: None}, slots, lambda worker: -1) == []
    assert unfinished_faults([node0, fault(FaultKind.WORKER_DIED, 1)], {0}) == [
        fault(FaultKind.WORKER_DIED, 1)]


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A TCP port whose connections the kernel accepts and nobody ever answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def test_an_s3_endpoint_that_black_holes_cannot_hold_the_plan(
        tmp_path: Path, black_hole: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    cfg = load_config("configs/demo.yaml", [
        "job.world_size=2", "spares.count=0", "recovery.group_timeout_s=2",
        "tiers.s3.enabled=true", "tiers.s3.bucket=phalanx-bounds",
        f"tiers.s3.endpoint_url=http://127.0.0.1:{black_hole}", f"job.run_dir={tmp_path}"])
    coord = RecoveryCoordinator(cfg, InMemoryMembership(), {}, None, lambda *a: None,
                                EventLog(tmp_path / "events.jsonl"), str(tmp_path))
    started = time.monotonic()
    inventory = coord._tiers()
    took = time.monotonic() - started
    assert took < 2 + 1.0, f"planning's tier inventory took {took:.1f} s"
    assert "s3" not in inventory.complete_steps and "disk" in inventory.complete_steps
    unreachable = events(tmp_path, "tier_unreachable")
    assert [(e["tier"], e["timeout_s"]) for e in unreachable] == [("s3", 2)]


def test_a_recovery_records_when_its_fresh_workers_registered(tmp_path: Path) -> None:
    """The recovered record carries ``workers_up_at``: when every spare / fresh worker of
    the plan had registered in the new generation (a fresh worker's start-up ends there),
    which a drill reports apart from the recovery time."""
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    pending = job.coord.pending
    assert pending is not None and pending.new_workers == {"w1-g1"}
    survivor = {"w0-g0": record("w0-g0", 0, 1, in_step=True)}
    job.coord.check_rejoined(survivor, set())
    assert pending.workers_up_at is None                 # the fresh worker is still starting
    before = time.time()
    members = {**survivor, "w1-g1": record("w1-g1", 1, 1, in_step=True)}
    job.coord.check_rejoined(members, set())
    assert pending.workers_up_at is not None and pending.workers_up_at >= before
    up = pending.workers_up_at
    stepped = {w: record(w, r, 1, step=9, first_step_at=time.time())
               for w, r in (("w0-g0", 0), ("w1-g1", 1))}
    assert job.coord.check_resumed(stepped) is not None
    (recovered,) = events(tmp_path, "recovered")
    assert recovered["workers_up_at"] == up


def test_a_fresh_worker_seen_a_poll_late_was_up_by_its_record_or_first_step(
        tmp_path: Path) -> None:
    job = fenced(tmp_path, InMemoryMembership(InMemoryStore()))
    job.kill_rank(1)
    pending = job.coord.pending
    assert pending is not None
    now = time.time()
    # first seen after its first step: the record (written then) and the step say earlier
    late = {"w0-g0": record("w0-g0", 0, 1), "w1-g0": record("w1-g0", 1, 0, time=now - 9),
            "w1-g1": record("w1-g1", 1, 1, time=now - 1.0, first_step_at=now - 1.5)}
    job.coord.check_rejoined(late, set())
    assert pending.workers_up_at == now - 1.5
    # first seen by the poll that completes the recovery (check_resumed runs first)
    pending.workers_up_at = None
    stepped = {w: record(w, r, 1, step=9, first_step_at=now - 0.5) for w, r in
               (("w0-g0", 0), ("w1-g1", 1))}
    assert job.coord.check_resumed(stepped) is not None
    (recovered,) = events(tmp_path, "recovered")
    assert recovered["workers_up_at"] == now - 0.5
