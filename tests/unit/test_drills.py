"""Drill scenarios: validation with clear errors, triggers (step, time, seeded
probability), the injector firing faults through a fake job, etcd-injected faults, and the
chaos campaign's reproducible draw. Every shipped scenario must load."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.configs.loader import load_config
from phalanx.launcher.drills.chaos import chaos_scenario, draw_faults
from phalanx.launcher.drills.scenario import (check_targets, load_scenario, parse_scenario,
                                             probability_step)
from phalanx.launcher.drills.catalogue import FaultSpec, catalogue
from phalanx.launcher.drills.injector import (GATE_QUORUM_S, INJECT_PREFIX, Deferred, Injector,
                                              gate_steps)
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.worker.drill_hooks import gate_key, gate_reason, hold_at_gate
from tests.fakes.membership_memory import InMemoryMembership as MemoryMembership

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs" / "drills").glob("*.yaml"))


def scenario(*faults: dict, **top: Any) -> dict:
    return {"name": "t", "faults": list(faults), **top}


KILL = {"kind": "kill_worker", "target": {"rank": 1}, "trigger": {"at_step": 5}}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenario_loads_and_its_overrides_are_valid_config(path: Path) -> None:
    loaded = load_scenario(path)
    assert loaded.faults and loaded.expect
    load_config(str(ROOT / "configs" / "demo.yaml"), loaded.override_args())


@pytest.mark.parametrize("raw, key, fragment", [
    (scenario(), "faults", "non-empty list"),
    (scenario({**KILL, "kind": "explode"}), "faults[0].kind", "not a known fault"),
    (scenario({**KILL, "target": {"node": 1}}), "faults[0].target.rank", "not a rank index"),
    (scenario({**KILL, "trigger": {}}), "faults[0].trigger", "no trigger"),
    (scenario({**KILL, "trigger": {"at_step": -1}}), "faults[0].trigger.at_step", "step >= 0"),
    (scenario({**KILL, "trigger": {"at_step": 3, "at_time_s": 1}}), "faults[0].trigger",
     "names"),
    (scenario({**KILL, "trigger": {"probability": 1.5, "steps": [1, 9]}}),
     "faults[0].trigger.probability", "(0, 1]"),
    (scenario({**KILL, "trigger": {"probability": 0.5, "steps": [9, 1]}}),
     "faults[0].trigger.steps", "[first, last]"),
    (scenario({**KILL, "params": {"for_s": 1}}), "faults[0].params.for_s", "not a parameter"),
    (scenario({"kind": "hang_worker", "target": {"rank": 0}, "trigger": {"at_step": 2},
               "params": {"for_s": "long"}}), "faults[0].params.for_s", "is not a float"),
    (scenario({"kind": "corrupt_snapshot", "target": {"rank": 0}, "trigger": {"at_step": 2},
               "params": {"where": "cloud"}}), "faults[0].params.where", "not allowed"),
    (scenario({"kind": "kill_spare", "target": {"role": "keeper"}, "trigger": {"at_step": 2}}),
     "faults[0].target.role", "not a role"),
    (scenario(KILL, expect={"max_lost_steps": -1}), "expect.max_lost_steps", "integer >= 0"),
    (scenario(KILL, expect={"max_after_workers_up_s": 0}), "expect.max_after_workers_up_s",
     "seconds > 0"),
    (scenario(KILL, expect={"final_state": "close"}), "expect.final_state", "identical or any"),
    (scenario(KILL, expect={"speed": 1}), "expect.speed", "not a drill key"),
    (scenario(KILL, needs=["gpu"]), "needs", "not a list of"),
    (scenario(KILL, colour="red"), "colour", "not a drill key"),
])
def test_bad_scenarios_name_the_key_value_and_fix(raw: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(raw, "drill.yaml")
    assert caught.value.key == key and fragment in str(caught.value), str(caught.value)
    assert "drill.yaml" in str(caught.value)


@pytest.mark.parametrize("target, key, fragment", [
    ({"rank": 2}, "faults[0].target.rank", "rank 2 is not in the job (2 ranks)"),
    ({"node": 3}, "faults[0].target.node", "node 3 is not in the job (3 nodes)"),
])
def test_a_fault_aimed_outside_the_job_is_refused_before_it_runs(
        target: dict, key: str, fragment: str) -> None:
    kind = "kill_worker" if "rank" in target else "kill_node"
    loaded = parse_scenario(scenario({**KILL, "kind": kind, "target": target}), "drill.yaml")
    with pytest.raises(ConfigError) as caught:
        check_targets(loaded, world_size=2, nodes=3)
    assert caught.value.key == key and fragment in str(caught.value), str(caught.value)
    assert "drill.yaml" in str(caught.value) and "--set job." in str(caught.value)
    check_targets(loaded, world_size=4, nodes=4)         # the same faults fit a larger job


def test_unreadable_scenario_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_scenario(tmp_path / "missing.yaml")


def test_probability_trigger_is_seeded_and_inside_its_range() -> None:
    spec = FaultSpec("kill_worker", index=2, rank=0, probability=0.2, steps=(10, 60), seed=7)
    first = probability_step(spec)
    assert first is not None and 10 <= first <= 60
    assert probability_step(spec) == first                       # same seed, same step
    others = {probability_step(FaultSpec("kill_worker", index=2, rank=0, probability=0.2,
                                         steps=(10, 60), seed=s)) for s in range(20)}
    assert len(others) > 3                                         # the seed matters
    never = FaultSpec("kill_worker", rank=0, probability=1e-9, steps=(1, 3), seed=1)
    assert probability_step(never) is None


class FakeEnv:
    """Records what mechanisms do to the job; a process table instead of real pids."""

    def __init__(self) -> None:
        self.signals: list[tuple[int, int]] = []
        self.emitted: list[tuple[str, dict]] = []
        self.deferred = Deferred(clock=lambda: self.now)
        self.now = 0.0
        self.run_dir = Path("/nonexistent")
        self.shm_dir, self.job = "/dev/shm", "t"

    def rank_pid(self, rank: int) -> int:
        return 1000 + rank

    def config(self) -> Any:
        return load_config(str(ROOT / "configs" / "demo.yaml"), [])

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self.deferred.add(seconds, action)

    def emit(self, event: str, **fields: Any) -> None:
        self.emitted.append((event, fields))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEnv:
    env = FakeEnv()
    import phalanx.launcher.drills.faults.process as process

    monkeypatch.setattr(process.os, "kill", lambda pid, sig: env.signals.append((pid, sig)))
    return env


def member(rank: int, step: int, held: bool = False) -> MemberRecord:
    extra = {"busy": gate_reason(step)} if held else {}
    return MemberRecord(worker_id=f"w{rank}", rank=rank, node="node0", step=step, generation=0,
                        pid=1000 + rank, extra=extra)


def held_at(step: int, ranks: int = 4) -> dict[str, MemberRecord]:
    return {f"w{r}": member(r, step, held=True) for r in range(ranks)}


def test_injector_fires_each_fault_once_when_due_and_undoes_a_timed_hang(fake: FakeEnv) -> None:
    import signal

    raw = scenario(KILL, {"kind": "hang_worker", "target": {"rank": 2},
                          "trigger": {"at_time_s": 2.0}, "params": {"for_s": 1.5}})
    membership = MemoryMembership()
    injector = Injector(parse_scenario(raw, "t.yaml"), fake, membership, fake.deferred,
                        clock=lambda: fake.now)
    injector.poll({"w0": member(0, 4)})
    assert fake.signals == []
    fake.now = 0.5
    injector.poll(held_at(5))             # every rank held at step 5; clock starts at step 1
    assert fake.signals == [(1001, signal.SIGKILL)]
    fake.now = 2.4
    injector.poll({"w0": member(0, 9)})
    assert fake.signals[-1] == (1002, signal.SIGSTOP)
    fake.now = 3.5
    injector.poll({"w0": member(0, 12)})
    assert fake.signals[-1] == (1002, signal.SIGSTOP)  # 1.5 s not over yet
    fake.now = 4.0
    injector.poll({"w0": member(0, 14)})
    assert fake.signals[-1] == (1002, signal.SIGCONT)
    fired = [f for e, f in fake.emitted if e == "drill_fault"]
    assert [(f["kind"], f["step"], f["target"]) for f in fired] == [
        ("kill_worker", 5, "rank 1"), ("hang_worker", 9, "rank 2")]
    assert [e for e, _ in fake.emitted].count("drill_fault_end") == 1


def test_a_step_fault_fires_with_every_rank_held_at_its_step_then_releases_them(
        fake: FakeEnv) -> None:
    import signal

    membership = MemoryMembership()
    later = {"kind": "kill_worker", "target": {"rank": 2}, "trigger": {"at_step": 9}}
    injector = Injector(parse_scenario(scenario(KILL, later), "t.yaml"), fake, membership,
                        fake.deferred, clock=lambda: fake.now)
    assert gate_steps(parse_scenario(scenario(KILL, later), "t.yaml")) == (5, 9)
    three = {**held_at(5, 3), "w3": member(3, 4)}
    injector.poll(three)                                # rank 3 not at the gate yet
    assert fake.signals == [] and membership.get(gate_key(5)) is None
    injector.poll(held_at(5))
    assert fake.signals == [(1001, signal.SIGKILL)]
    assert membership.get(gate_key(5)) is not None and membership.get(gate_key(9)) is None
    fake.now = 10.0                                      # a rank that never comes (hung):
    injector.poll({**held_at(9, 3), "w3": member(3, 8)})
    assert len(fake.signals) == 1                        # waited for ...
    fake.now = 10.0 + GATE_QUORUM_S
    injector.poll({**held_at(9, 3), "w3": member(3, 8)})
    assert fake.signals[-1] == (1002, signal.SIGKILL)    # ... at most GATE_QUORUM_S
    assert membership.get(gate_key(9)) is not None
    fired = [f["step"] for e, f in fake.emitted if e == "drill_fault"]
    assert fired == [5, 9]


def test_a_step_fault_with_no_gated_ranks_fires_once_a_rank_is_past_it(fake: FakeEnv) -> None:
    import signal

    injector = Injector(parse_scenario(scenario(KILL), "t.yaml"), fake, MemoryMembership(),
                        fake.deferred, clock=lambda: fake.now)
    injector.poll({"w0": member(0, 5)})      # a script without session.step(): never held
    assert fake.signals == []
    injector.poll({"w0": member(0, 6)})
    assert fake.signals == [(1001, signal.SIGKILL)]


def test_a_held_rank_waits_for_its_gate_and_gives_up_on_a_newer_generation() -> None:
    membership, clock = MemoryMembership(), [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if clock[0] >= 1.0:
            membership.put(gate_key(7), b"fired")

    assert hold_at_gate(membership, 7, lambda: False, wait_s=5, clock=lambda: clock[0],
                        sleep=sleep)
    assert 1.0 <= clock[0] < 1.1
    assert hold_at_gate(membership, 7, lambda: True)     # released already: passes at once
    clock[0] = 0.0
    assert not hold_at_gate(membership, 8, lambda: clock[0] > 0.5, wait_s=5,
                            clock=lambda: clock[0], sleep=sleep)
    assert clock[0] < 0.6
    clock[0] = 0.0
    assert not hold_at_gate(membership, 8, lambda: False, wait_s=2, clock=lambda: clock[0],
                            sleep=sleep)
    assert 2.0 <= clock[0] < 2.1


def test_a_worker_exception_at_a_gate_is_raised_after_the_gates_etcd_read_not_inside_it(
        ) -> None:
    """A real SIGUSR1 arriving while the held rank reads its gate from etcd: the read ends
    (gRPC's state left whole) and ``InjectedFault`` is raised after it, from the gate."""
    import os
    import signal

    from phalanx.configs.errors import InjectedFault
    from phalanx.runtime.worker.drill_hooks import raise_on_sigusr1

    class Signalled(MemoryMembership):
        reads_ended = 0

        def get(self, key: str) -> Any:
            os.kill(os.getpid(), signal.SIGUSR1)    # the launcher's worker_exception fault
            for _ in range(1000):                   # Python code after it: the handler runs
                pass
            Signalled.reads_ended += 1
            return super().get(key)

    before = signal.getsignal(signal.SIGUSR1)
    raise_on_sigusr1()
    try:
        with pytest.raises(InjectedFault, match="worker_exception injected"):
            hold_at_gate(Signalled(), 9, lambda: False, wait_s=5)
        assert Signalled.reads_ended == 1
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_faults_written_to_etcd_are_fired_and_bad_ones_refused(fake: FakeEnv) -> None:
    import json
    import signal

    membership = MemoryMembership()
    injector = Injector(None, fake, membership, fake.deferred, clock=lambda: fake.now)
    membership.put(INJECT_PREFIX + "a", json.dumps(
        {"kind": "kill_worker", "target": {"rank": 3}, "trigger": {"at_time_s": 0}}).encode())
    membership.put(INJECT_PREFIX + "b", b'{"kind": "melt", "target": {}, "trigger": {}}')
    injector.poll({"w0": member(0, 7)})
    assert fake.signals == [(1003, signal.SIGKILL)]
    assert membership.list_prefix(INJECT_PREFIX) == []
    refused = [f for e, f in fake.emitted if e == "drill_inject_refused"]
    assert len(refused) == 1 and "not a known fault" in refused[0]["error"]
    fired = [f for e, f in fake.emitted if e == "drill_fault"]
    assert fired[0]["origin"] == "inject"


def test_a_mechanism_that_fails_is_reported_not_raised(fake: FakeEnv) -> None:
    raw = scenario({"kind": "kill_spare", "target": {"role": "spare"}, "trigger": {"at_step": 1}})
    fake.spare_pids = lambda: {}
    injector = Injector(parse_scenario(raw, "t.yaml"), fake, MemoryMembership(), fake.deferred)
    injector.poll(held_at(1))
    fired = [f for e, f in fake.emitted if e == "drill_fault"]
    assert "no spare to kill" in fired[0]["details"]["error"]


def test_chaos_draw_is_reproducible_recoverable_and_spaced() -> None:
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), [])
    first, again = draw_faults(cfg, 10, seed=3), draw_faults(cfg, 10, seed=3)
    assert first == again and draw_faults(cfg, 10, seed=4) != first
    kinds = catalogue()
    assert all(kinds[f["kind"]].chaos and not kinds[f["kind"]].needs for f in first)
    assert all(f["kind"] != "kill_node" for f in first)          # 2 nodes: none to spare
    steps = [f["trigger"]["at_step"] for f in first]
    assert steps == sorted(steps) and len(set(steps)) == 10
    raw = chaos_scenario(cfg, 10, 3, max_minutes=5)
    parsed = parse_scenario(raw, "chaos.yaml")
    assert raw["overrides"]["job.args.steps"] > max(steps)
    assert parsed.expect["final_state"] == "identical"


def test_partition_cuts_only_connections_that_cross_the_node_and_its_listeners() -> None:
    from phalanx.launcher.drills.faults.partition import Socket, crossing

    sockets = [Socket(5000, 0, 1, True),          # node listener
               Socket(6000, 0, 9, True),          # outside listener
               Socket(41000, 5000, 2, False), Socket(5000, 41000, 3, False),  # inside<->inside
               Socket(42000, 6000, 4, False), Socket(6000, 42000, 10, False),  # inside->out
               Socket(43000, 6000, 11, False), Socket(6000, 43000, 12, False),  # out<->out
               Socket(44000, 7000, 5, False)]     # inside -> somewhere not on this host
    inside = {1, 2, 3, 4, 5}
    assert sorted(crossing(sockets, inside)) == [(5000, 0), (6000, 42000), (42000, 6000),
                                                 (44000, 7000)]


def test_a_drill_of_a_script_without_a_session_is_refused_naming_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unchanged torchrun script (no phalanx.Session) counts no step and reports no
    state: its fault-free run ends with exit 0 and no final hash. The drill stops there
    with the reason, instead of a drilled run whose step faults never fire."""
    from phalanx.launcher.drills import commands
    from phalanx.launcher.drills.report import RunOutcome

    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    launched: list[list[str]] = []

    def launch(config: str, overrides: Any) -> RunOutcome:
        launched.append(list(overrides))
        return RunOutcome(0, {}, tmp_path / "run", "", 1.0)

    monkeypatch.setattr(commands, "launch", launch)
    overrides = [f"job.entrypoint={script}", "job.argv=[]", f"job.run_dir={tmp_path}"]
    with pytest.raises(ConfigError) as caught:
        commands.reference_hashes(str(ROOT / "configs" / "demo.yaml"), overrides,
                                  commands.Console(file=io.StringIO()))
    assert caught.value.key == "job.entrypoint" and str(script) in caught.value.problem
    assert "phalanx.Session" in caught.value.problem and "docs/porting.md" in caught.value.hint
    assert len(launched) == 1 and not list((tmp_path / "references").glob("*"))
    # a run that failed is still reported as a failed reference, not as a missing Session
    monkeypatch.setattr(commands, "launch", lambda c, o: RunOutcome(1, {}, None, "exit 1"))
    hashes, source = commands.reference_hashes(str(ROOT / "configs" / "demo.yaml"), overrides,
                                               commands.Console(file=io.StringIO()))
    assert hashes is None and source == "fault-free run failed (exit 1)"
