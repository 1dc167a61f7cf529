"""The coordinator's phase machine: the transitions table, refusals, logging and timings."""
from __future__ import annotations

import logging
import pickle

import pytest

from phalanx.configs.errors import FatalError, PhalanxError
from phalanx.recovery.base import InvalidTransition
from phalanx.recovery.phases import ALLOWED, Phase, PhaseMachine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

HAPPY_PATH = [Phase.DETECTING, Phase.PLANNING, Phase.FENCING, Phase.PROMOTING,
              Phase.RESTORING, Phase.RESUMING, Phase.STEADY]
RECOVERING = [Phase.PLANNING, Phase.FENCING, Phase.PROMOTING, Phase.RESTORING,
              Phase.RESUMING, Phase.DEGRADED]


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def walk(machine: PhaseMachine, clock: ManualClock, path: list[Phase],
         step_s: float = 1.0) -> None:
    for phase in path:
        clock.advance(step_s)
        machine.transition(phase, f"to {phase.value}")


def test_table_covers_every_phase_and_failed_is_terminal() -> None:
    assert set(ALLOWED) == set(Phase)
    assert ALLOWED[Phase.FAILED] == frozenset()
    for phase in Phase:
        if phase is not Phase.FAILED:
            assert Phase.FAILED in ALLOWED[phase], phase
    for phase in RECOVERING:
        assert Phase.DETECTING in ALLOWED[phase], phase  # a new fault restarts recovery


def test_happy_path_records_history_and_timings() -> None:
    clock = ManualClock(100.0)
    machine = PhaseMachine(clock)
    assert machine.phase is Phase.STEADY and machine.entered_at == 100.0
    walk(machine, clock, HAPPY_PATH, step_s=0.5)
    assert machine.phase is Phase.STEADY
    assert [c.to_phase for c in machine.history] == HAPPY_PATH
    assert [c.from_phase for c in machine.history] == [Phase.STEADY] + HAPPY_PATH[:-1]
    assert machine.history[2].at == 101.5
    assert machine.history[2].reason == "to fencing"
    assert machine.timings() == {p.value: 0.5 for p in [Phase.STEADY] + HAPPY_PATH[:-1]}


def test_timings_accumulate_over_visits_and_exclude_the_open_phase() -> None:
    clock = ManualClock()
    machine = PhaseMachine(clock)
    walk(machine, clock, [Phase.DETECTING, Phase.STEADY], step_s=2.0)
    walk(machine, clock, [Phase.DETECTING, Phase.PLANNING], step_s=3.0)
    clock.advance(100.0)  # still planning: not counted until it ends
    assert machine.timings() == {"steady": 5.0, "detecting": 5.0}


@pytest.mark.parametrize(("path", "refused"), [
    pytest.param([], Phase.PLANNING, id="steady-cannot-plan"),
    pytest.param([], Phase.STEADY, id="no-self-transition"),
    pytest.param([Phase.DETECTING], Phase.RESTORING, id="detecting-skips-ahead"),
    pytest.param([Phase.DETECTING, Phase.PLANNING], Phase.RESUMING, id="planning-to-resuming"),
    pytest.param([Phase.DETECTING, Phase.PLANNING, Phase.DEGRADED], Phase.STEADY,
                 id="degraded-needs-a-plan"),
    pytest.param([Phase.FAILED], Phase.STEADY, id="failed-is-terminal"),
    pytest.param([Phase.FAILED], Phase.DETECTING, id="failed-stays-failed"),
])
def test_refused_transitions_raise_and_leave_state_unchanged(path: list[Phase],
                                                             refused: Phase) -> None:
    clock = ManualClock()
    machine = PhaseMachine(clock)
    walk(machine, clock, path)
    before = (machine.phase, machine.history, machine.timings())
    with pytest.raises(InvalidTransition) as info:
        machine.transition(refused, "bad idea")
    assert (machine.phase, machine.history, machine.timings()) == before
    assert info.value.from_phase == machine.phase.value and info.value.to_phase == refused.value
    assert "bad idea" in str(info.value) and "not allowed" in str(info.value)


@pytest.mark.parametrize("path", [
    pytest.param([Phase.DETECTING, Phase.STEADY], id="false-alarm"),
    pytest.param([Phase.DETECTING, Phase.PLANNING, Phase.DEGRADED, Phase.PLANNING,
                  Phase.FENCING], id="wait-then-plan"),
    pytest.param([Phase.DETECTING, Phase.PLANNING, Phase.FENCING, Phase.PLANNING],
                 id="fence-race-replans"),
    pytest.param([Phase.DETECTING, Phase.PLANNING, Phase.FENCING, Phase.RESTORING,
                  Phase.RESUMING, Phase.STEADY], id="nothing-to-promote"),
    pytest.param([Phase.DETECTING, Phase.PLANNING, Phase.FENCING, Phase.PROMOTING,
                  Phase.DETECTING], id="fault-during-recovery"),
    pytest.param([Phase.DETECTING, Phase.PLANNING, Phase.FAILED], id="abort"),
])
def test_allowed_paths(path: list[Phase]) -> None:
    clock = ManualClock()
    machine = PhaseMachine(clock)
    walk(machine, clock, path)
    assert machine.phase is path[-1]


def test_each_transition_logs_one_key_value_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    machine = PhaseMachine(clock)
    with caplog.at_level(logging.INFO, logger="phalanx.recovery.phases"):
        clock.advance(0.25)
        machine.transition(Phase.DETECTING, "actor w3-g0 died")
        with pytest.raises(InvalidTransition):
            machine.transition(Phase.RESUMING, "nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "phalanx.recovery.phases"]
    assert lines == ["event=phase from=steady to=detecting duration_s=0.250000 "
                     "reason='actor w3-g0 died'"]


def test_invalid_transition_is_a_fatal_phalanx_error_that_pickles() -> None:
    error = InvalidTransition("steady", "resuming", "why")
    assert isinstance(error, FatalError) and isinstance(error, PhalanxError)
    again = pickle.loads(pickle.dumps(error))
    assert (again.from_phase, again.to_phase, again.reason, str(again)) == (
        "steady", "resuming", "why", str(error))


def test_history_is_a_copy() -> None:
    clock = ManualClock()
    machine = PhaseMachine(clock)
    machine.transition(Phase.DETECTING, "x")
    machine.history.clear()
    assert len(machine.history) == 1
