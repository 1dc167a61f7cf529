"""``trigger.after_tier_commit``: a step fault that needs a tier checkpoint fires at its step
only once the tier lists that step committed for the run, bounded; its parsing names the
file, key, value and fix."""
from __future__ import annotations

import signal

import pytest

from phalanx.configs.errors import ConfigError, TierUnavailable
from phalanx.launcher.drills.catalogue import TierPrecondition
from phalanx.launcher.drills.injector import TIER_POLL_S, Injector
from phalanx.launcher.drills.scenario import load_scenario, parse_scenario
from phalanx.runtime.worker.drill_hooks import gate_key
from tests.fakes.membership_memory import InMemoryMembership as MemoryMembership
from tests.unit.test_drills import ROOT, FakeEnv, held_at, scenario

pytestmark = pytest.mark.unit

AFTER = {"tier": "disk", "step": 20, "within_s": 10}
KILL30 = {"kind": "kill_worker", "target": {"rank": 1},
          "trigger": {"at_step": 30, "after_tier_commit": AFTER}}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEnv:
    env = FakeEnv()
    import phalanx.launcher.drills.faults.process as process

    monkeypatch.setattr(process.os, "kill", lambda pid, sig: env.signals.append((pid, sig)))
    return env


def test_after_tier_commit_parses_and_shows_in_the_trigger_text() -> None:
    [spec] = parse_scenario(scenario(KILL30), "t.yaml").faults
    assert spec.at_step == 30
    assert spec.after_tier_commit == TierPrecondition("disk", 20, 10.0)
    assert spec.trigger_text() == "at step 30 once disk holds step 20 committed (up to 10 s)"
    default = {**KILL30, "trigger": {"at_step": 30,
                                     "after_tier_commit": {"tier": "s3", "step": 30}}}
    [spec] = parse_scenario(scenario(default), "t.yaml").faults
    assert spec.after_tier_commit == TierPrecondition("s3", 30, 15.0)


def test_the_shipped_tier_fallback_drill_waits_for_its_disk_checkpoint() -> None:
    drill = load_scenario(ROOT / "configs" / "drills" / "tier_fallback.yaml")
    assert {f.after_tier_commit for f in drill.faults} == {TierPrecondition("disk", 20, 15.0)}


@pytest.mark.parametrize("after, key, fragment", [
    ({**AFTER, "tier": "tape"}, "after_tier_commit.tier", "'tape' is not a tier"),
    ({**AFTER, "step": 31}, "after_tier_commit.step", "not a step in [0, at_step=30]"),
    ({**AFTER, "step": "20"}, "after_tier_commit.step", "not a step"),
    ({**AFTER, "within_s": 0}, "after_tier_commit.within_s", "seconds in (0, 15]"),
    ({**AFTER, "within_s": 16}, "after_tier_commit.within_s", "seconds in (0, 15]"),
    ({**AFTER, "wait": 1}, "after_tier_commit.wait", "not a drill key"),
    ([20], "after_tier_commit", "not a mapping"),
])
def test_bad_after_tier_commit_names_key_value_and_fix(after: object, key: str,
                                                       fragment: str) -> None:
    raw = scenario({**KILL30, "trigger": {"at_step": 30, "after_tier_commit": after}})
    with pytest.raises(ConfigError) as caught:
        parse_scenario(raw, "drill.yaml")
    assert caught.value.key == f"faults[0].trigger.{key}", str(caught.value)
    assert fragment in str(caught.value) and "drill.yaml" in str(caught.value)
    assert "tier" in caught.value.hint          # the fix names what to write


def test_after_tier_commit_only_holds_a_step_fault() -> None:
    raw = scenario({**KILL30, "trigger": {"at_time_s": 3, "after_tier_commit": AFTER}})
    with pytest.raises(ConfigError, match="use it with at_step") as caught:
        parse_scenario(raw, "drill.yaml")
    assert caught.value.key == "faults[0].trigger.after_tier_commit"


def _injector(env: FakeEnv, listed: list[list[int]], membership: MemoryMembership) -> Injector:
    def tier_steps(name: str) -> list[int]:
        assert name == "disk"
        return listed[0]
    return Injector(parse_scenario(scenario(KILL30), "t.yaml"), env, membership,
                    env.deferred, clock=lambda: env.now, tier_steps=tier_steps)


def test_a_held_fault_fires_at_its_step_once_the_tier_lists_the_checkpoint(fake: FakeEnv) -> None:
    membership, listed = MemoryMembership(), [[10]]
    injector = _injector(fake, listed, membership)
    injector.poll(held_at(30))                 # every rank held at step 30; no step 20 yet
    fake.now = 2.0
    injector.poll(held_at(30))
    assert fake.signals == [] and membership.get(gate_key(30)) is None   # still held
    listed[0] = [10, 20]
    fake.now = 2.0 + TIER_POLL_S
    injector.poll(held_at(30))
    assert fake.signals == [(1001, signal.SIGKILL)]
    assert membership.get(gate_key(30)) is not None                    # then released
    [fired] = [f for e, f in fake.emitted if e == "drill_fault"]
    assert fired["step"] == 30 and "once disk holds step 20" in fired["trigger"]
    assert fired["precondition"] == {"tier": "disk", "step": 20, "met": True,
                                     "waited_s": 2.0 + TIER_POLL_S, "within_s": 10.0}
    assert "drill_precondition_unmet" not in [e for e, _ in fake.emitted]


def test_past_its_bound_the_fault_fires_anyway_and_says_the_checkpoint_was_missing(
        fake: FakeEnv) -> None:
    membership, listed = MemoryMembership(), [[]]
    injector = _injector(fake, listed, membership)
    injector.poll(held_at(30))
    fake.now = 9.9
    injector.poll(held_at(30))
    assert fake.signals == []
    fake.now = 10.0
    injector.poll(held_at(30))
    assert fake.signals == [(1001, signal.SIGKILL)]
    [unmet] = [f for e, f in fake.emitted if e == "drill_precondition_unmet"]
    assert unmet == {"index": 0, "kind": "kill_worker", "tier": "disk", "step": 20,
                     "met": False, "waited_s": 10.0, "within_s": 10.0}
    [fired] = [f for e, f in fake.emitted if e == "drill_fault"]
    assert fired["precondition"]["met"] is False


def test_a_tier_that_cannot_be_listed_counts_as_not_yet(fake: FakeEnv) -> None:
    calls = []

    def failing(name: str) -> list[int]:
        calls.append(name)
        raise TierUnavailable("tier disk: listing failed")
    injector = Injector(parse_scenario(scenario(KILL30), "t.yaml"), fake, MemoryMembership(),
                        fake.deferred, clock=lambda: fake.now, tier_steps=failing)
    for tick in range(5):
        fake.now = tick * TIER_POLL_S / 2     # asked at most every TIER_POLL_S
        injector.poll(held_at(30))
    assert fake.signals == [] and len(calls) == 3


def test_the_default_listing_reads_this_runs_disk_tier(fake: FakeEnv, tmp_path) -> None:
    from phalanx.runtime.tiers.disk import DiskTier

    fake.run_dir = tmp_path / "demo-1"
    membership = MemoryMembership()
    injector = Injector(parse_scenario(scenario(KILL30), "t.yaml"), fake, membership,
                        fake.deferred, clock=lambda: fake.now)
    injector.poll(held_at(30))
    assert fake.signals == []
    tier = DiskTier(fake.run_dir / "checkpoints", fake.config().job.name, run_id="demo-1")
    for rank in range(4):
        tier.write_rank(20, rank, b"x" * 8, b"{}")
    tier.commit_step(20, [0, 1, 2, 3])
    fake.now = TIER_POLL_S
    injector.poll(held_at(30))
    assert fake.signals == [(1001, signal.SIGKILL)]
