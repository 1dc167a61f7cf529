"""The coordinator's fence and its transient failures, with the in-memory membership and a
fake clock: the plan and the generation move together or not at all; a lost fence stops
this coordinator like a lost lease (no worker started, nothing written over the winner's
plan); etcd blips and keepers too busy to answer are retried within the recovery's
deadline, then fail with ``RecoveryStalled``; and a job whose standby leads is handed over,
not torn down. Also a fault before the first commit: every rank starts over."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError

from phalanx.configs.errors import MembershipUnavailable
from phalanx.configs.loader import load_config
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.coordination.retry import RecoveryStalled
from phalanx.launcher.events import EventLog
from phalanx.launcher.job import JobRunner
from phalanx.launcher.services.leadership import FenceLost, Leadership, LeadershipLost
from phalanx.recovery.base import FaultKind, FaultReport, TierInventory
from phalanx.runtime.base import NodeId, Rank, Step
from phalanx.runtime.membership.generation import GENERATION_KEY, GenerationPlan, plan_key
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]
BUDGET_S = 30.0        # recovery.group_timeout_s of these tests: the retry deadline


class Clock:
    """The coordinator's clock; its sleep advances it (no real waiting)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Flaky(InMemoryMembership):
    """The fake etcd, unreachable for the first ``failures`` reads and transactions."""

    def __init__(self, store: InMemoryStore, failures: int) -> None:
        super().__init__(store)
        self.failures = failures
        self.calls = 0
        self.lose_next_answer = False    # the next transaction is done, its reply lost

    def _blip(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise MembershipUnavailable(f"etcd 127.0.0.1:2379 get failed (blip {self.calls})")

    def get(self, key: str) -> Any:
        self._blip()
        return super().get(key)

    def put_if(self, key: str, expected_revision: int, writes: Any) -> bool:
        self._blip()
        done = super().put_if(key, expected_revision, writes)
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise MembershipUnavailable("etcd put_if failed: DEADLINE_EXCEEDED")
        return done


class Job:
    """A coordinator of a 2-rank job that has committed step 5 in the disk tier, with
    every worker it launches recorded."""

    def __init__(self, tmp_path: Path, membership: InMemoryMembership,
                 keepers: dict[int, Any] | None = None, committed: int = 5) -> None:
        cfg = load_config("configs/demo.yaml", [
            "job.world_size=2", "spares.count=0", "tiers.s3.enabled=false",
            f"recovery.group_timeout_s={BUDGET_S}"])
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.clock = Clock()
        self.launched: list[tuple[int, str, int, dict | None]] = []
        self.events = EventLog(tmp_path / "events.jsonl")
        self.coord = RecoveryCoordinator(cfg, membership, keepers or {}, None, self._launch,
                                         self.events, str(tmp_path), clock=self.clock,
                                         sleep=self.clock.sleep)
        steps = (Step(committed),) if committed >= 0 else ()
        self.coord._tiers = lambda: TierInventory({"disk": steps})  # type: ignore[method-assign]
        self.coord.committed = lambda: committed
        self.slots = {r: RankSlot(r, f"w{r}-g0", r, f"actor{r}", name=f"rank{r}")
                      for r in range(2)}

    def _launch(self, slot: RankSlot, generation: int, restore: dict | None) -> str:
        self.launched.append((slot.rank, slot.worker_id, generation, restore))
        return f"ref-{slot.worker_id}"

    def kill_rank(self, rank: int) -> None:
        self.coord.recover([FaultReport(FaultKind.WORKER_DIED, (Rank(rank),),
                                        NodeId(f"node{rank}"), self.clock(), "killed")],
                           self.slots)


def fenced(tmp_path: Path, membership: InMemoryMembership, **kwargs: Any) -> Job:
    job = Job(tmp_path, membership, **kwargs)
    job.coord.fence_initial()
    return job


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    return killed


def test_plan_and_generation_are_fenced_in_one_step(tmp_path: Path, kills: list[Any]) -> None:
    store = InMemoryStore()
    job = fenced(tmp_path, InMemoryMembership(store))
    job.kill_rank(1)
    generation, plan = store.get(GENERATION_KEY), store.get(plan_key(1))
    assert generation is not None and generation.value == b"1"
    assert plan is not None and plan.mod_revision == generation.mod_revision
    assert GenerationPlan.decode(plan.value).restore_step == 5
    assert [(rank, gen) for rank, _, gen, _ in job.launched] == [(1, 1)]


def test_a_lost_fence_stops_the_coordinator_like_a_lost_lease(tmp_path: Path,
                                                               kills: list[Any]) -> None:
    store = InMemoryStore()
    stale = fenced(tmp_path / "a", InMemoryMembership(store))
    winner = Job(tmp_path / "b", InMemoryMembership(store))   # a standby that took over
    winner.kill_rank(1)
    winners_plan = store.get(plan_key(1))
    assert winners_plan is not None

    with pytest.raises(FenceLost) as lost:
        stale.kill_rank(1)          # the stalled ex-leader plans generation 1 too

    assert isinstance(lost.value, LeadershipLost)     # the job hands over, tears nothing down
    assert "another coordinator leads" in str(lost.value)
    assert store.get(plan_key(1)) == winners_plan     # the winner's plan, untouched
    assert store.get(GENERATION_KEY).value == b"1"    # type: ignore[union-attr]
    assert stale.launched == [] and stale.coord.generation == 0
    assert [e for e in stale.events.events if e["event"] == "fence_lost"]


def test_an_etcd_blip_while_fencing_is_retried_within_the_deadline(tmp_path: Path,
                                                                   kills: list[Any]) -> None:
    store = InMemoryStore()
    InMemoryMembership(store).compare_and_swap(GENERATION_KEY, 0, b"0")
    flaky = Flaky(store, failures=3)
    job = Job(tmp_path, flaky)

    job.kill_rank(1)

    assert store.get(GENERATION_KEY).value == b"1"    # type: ignore[union-attr]
    assert store.get(plan_key(1)) is not None
    assert len(job.clock.slept) == 3 and sum(job.clock.slept) < BUDGET_S
    assert [(rank, gen) for rank, _, gen, _ in job.launched] == [(1, 1)]

    flaky.lose_next_answer = True     # fenced, but the reply is lost: read back as ours
    job.kill_rank(0)
    assert job.coord.generation == 2 and store.get(GENERATION_KEY).value == b"2"  # type: ignore[union-attr]
    assert [(rank, gen) for rank, _, gen, _ in job.launched][1:] == [(0, 2)]


def test_etcd_down_past_the_deadline_fails_with_a_named_error(tmp_path: Path,
                                                              kills: list[Any]) -> None:
    store = InMemoryStore()
    InMemoryMembership(store).compare_and_swap(GENERATION_KEY, 0, b"0")
    job = Job(tmp_path, Flaky(store, failures=10_000))
    started = job.clock()

    with pytest.raises(RecoveryStalled) as stalled:
        job.kill_rank(1)

    assert BUDGET_S <= job.clock() - started <= BUDGET_S + 1.5
    message = str(stalled.value)
    assert "fencing generation 1" in message and "recovery.group_timeout_s" in message
    assert "MembershipUnavailable" in message
    assert job.launched == [] and store.get(plan_key(1)) is None


class BusyKeeper:
    """A keeper actor whose ``set_targets`` answers after ``late`` timeouts."""

    def __init__(self) -> None:
        self.asked = 0
        outer = self

        class Method:
            def remote(self, *args: Any) -> str:
                outer.asked += 1
                return "ref"
        self.set_targets = Method()


def test_a_busy_keeper_is_asked_again_then_fails_at_the_deadline(
        tmp_path: Path, kills: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    keeper = BusyKeeper()
    job = Job(tmp_path, InMemoryMembership(), keepers={0: (keeper, ("127.0.0.1", 7000))})
    timeouts = {"left": 2}

    def get(ref: Any, timeout: float | None = None) -> Any:
        if timeouts["left"] > 0:
            timeouts["left"] -= 1
            job.clock.now += timeout or 0
            raise GetTimeoutError("Get timed out: some object(s) not ready")
        return None
    monkeypatch.setattr(ray, "get", get)

    job.coord.place(job.slots)
    assert keeper.asked == 3

    timeouts["left"] = 10_000
    started = job.clock()
    with pytest.raises(RecoveryStalled, match="replica targets of keeper node0"):
        job.coord.place(job.slots)
    assert job.clock() - started <= BUDGET_S + 1.5


def test_a_keeper_that_times_out_on_a_node_that_answers_nothing_is_a_lost_node(
        tmp_path: Path, kills: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead host or a cut link (no socket closes; its lease not lapsed yet): its keeper's
    first try times out and the node watch finds it silent, so the node is forgotten at
    once instead of being retried until the recovery stalls. A keeper that times out on a
    node that answers is retried as before."""
    keeper = BusyKeeper()
    job = Job(tmp_path, InMemoryMembership(), keepers={0: (keeper, ("127.0.0.1", 7000))})
    asked: list[int] = []
    job.coord.silent = lambda node: asked.append(node) or True

    def get(ref: Any, timeout: float | None = None) -> Any:
        job.clock.now += timeout or 0
        raise GetTimeoutError("Get timed out: some object(s) not ready")
    monkeypatch.setattr(ray, "get", get)

    started = job.clock()
    job.coord.place(job.slots)
    assert keeper.asked == 1 and asked == [0] and 0 not in job.coord.live_nodes
    assert job.clock() - started <= 2.0 + 1e-6                 # one short first try
    assert any(e["event"] == "node_silent" for e in job.coord.events.events)

    job.coord.live_nodes.add(0)
    job.coord.silent = lambda node: False
    with pytest.raises(RecoveryStalled, match="replica targets of keeper node0"):
        job.coord.place(job.slots)
    assert 0 in job.coord.live_nodes


def test_a_lost_leadership_ends_the_retries_at_once(tmp_path: Path, kills: list[Any]) -> None:
    store = InMemoryStore()
    InMemoryMembership(store).compare_and_swap(GENERATION_KEY, 0, b"0")
    job = Job(tmp_path, Flaky(store, failures=10_000))

    def lease_gone() -> None:
        raise LeadershipLost("the coordinator lease was lost")
    job.coord.still_leading = lease_gone

    with pytest.raises(LeadershipLost):
        job.kill_rank(1)
    assert len(job.clock.slept) == 0 and job.launched == []


def test_a_fault_before_the_first_commit_starts_every_rank_over(tmp_path: Path,
                                                                kills: list[Any]) -> None:
    store = InMemoryStore()
    job = fenced(tmp_path, InMemoryMembership(store), committed=-1)

    job.kill_rank(1)

    launched = sorted(job.launched)
    assert launched == [(0, "w0-g1", 1, None), (1, "w1-g1", 1, None)]   # fresh, no restore
    assert sorted(kills) == ["actor0", "actor1"]      # the survivor's old process goes too
    assert {r: s.worker_id for r, s in job.slots.items()} == {0: "w0-g1", 1: "w1-g1"}
    plan = GenerationPlan.decode(store.get(plan_key(1)).value)   # type: ignore[union-attr]
    assert plan.restore_step == -1 and "start over" in plan.reason
    assert not [e for e in job.events.events if e["event"] == "job_failed"]


def runner(tmp_path: Path, standby: bool) -> tuple[JobRunner, Job, InMemoryStore]:
    """A job runner whose watch loop fails in a recovery: ``RecoveryStalled`` (etcd
    unreachable from this launcher past the deadline)."""
    store = InMemoryStore()
    job = fenced(tmp_path, InMemoryMembership(store))
    leadership = Leadership(InMemoryMembership(store), ttl_s=5,  # type: ignore[arg-type]
                            step_down_when_silent=standby)
    assert leadership.try_acquire()
    run = JobRunner.__new__(JobRunner)
    run.keepers = {}                    # as __init__ sets it: no keepers in this job
    run.cfg = load_config("configs/demo.yaml", [
        f"coordinator.standby={str(standby).lower()}", "etcd.endpoints=[\"127.0.0.1:2379\"]",
        "ray.address=127.0.0.1:6379"])
    run.services = SimpleNamespace(leadership=leadership)   # type: ignore[assignment]
    run.handed_over = False

    def watch(*args: Any) -> Any:
        raise RecoveryStalled("fencing generation 1 failed 60 time(s) within the recovery's 30 s")
    run._watch = watch       # type: ignore[method-assign]
    return run, job, store


def test_a_standby_is_never_left_with_a_torn_down_job(tmp_path: Path, kills: list[Any]) -> None:
    run, job, store = runner(tmp_path, standby=True)
    store.expire_now(run.services.leadership._membership.lease_id)  # lease gone meanwhile

    with pytest.raises(LeadershipLost, match="left to the standby"):
        run._finish(SimpleNamespace(path=tmp_path), job.slots,  # type: ignore[arg-type]
                    job.coord, 0.0)

    assert run.handed_over
    run._release_actor("actor0")      # what the launcher's exit stack does with each actor
    assert kills == []
    assert not [e for e in job.events.events if e["event"] == "job_failed"]


def test_without_a_standby_a_stalled_recovery_fails_the_job(tmp_path: Path,
                                                            kills: list[Any]) -> None:
    run, job, _ = runner(tmp_path, standby=False)
    with pytest.raises(RecoveryStalled):
        run._finish(SimpleNamespace(path=tmp_path), job.slots,  # type: ignore[arg-type]
                    job.coord, 0.0)
    assert not run.handed_over
    assert [e for e in job.events.events if e["event"] == "job_failed"]
