"""Goodput from synthetic event sequences: a clean run, a recovery with a rollback, waiting
for capacity, a failed run, a live one; the parts always sum to the wall time and
``effective = productive / wall``; the run summary built and reconstructed from them."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.launcher.goodput import (Goodput, Window, account, goodput_from_events,
                                      markdown_breakdown, summary_line)
from phalanx.launcher.run_summary import build_summary, read_summary, reconstruct, write_summary

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
T0 = 1_000.0


def ev(event: str, at: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": T0 + at, **fields}


def progress(at: float, step: int, generation: int = 0, **fields: Any) -> dict[str, Any]:
    return ev("progress", at, min_step=step, max_step=step, generation=generation, **fields)


def phases(*changes: tuple[float, str, str]) -> list[dict[str, Any]]:
    return [ev("phase", at, **{"from": a, "to": b}) for at, a, b in changes]


def assert_sums(goodput: Goodput) -> None:
    total = sum(goodput.parts().values())
    assert abs(total - goodput.wall_s) <= 0.01 * goodput.wall_s
    assert abs(total - goodput.wall_s) < 1e-6          # in fact exact
    assert all(seconds >= 0 for seconds in goodput.parts().values()), goodput.parts()
    assert goodput.effective == pytest.approx(goodput.productive_s / goodput.wall_s)
    doc = goodput.to_json()
    assert abs(doc["sum_s"] - doc["wall_s"]) <= 0.01 * doc["wall_s"]


def clean_events() -> list[dict[str, Any]]:
    return [ev("started", 2.0), progress(4.0, 0), ev("first_step", 5.0, step=1, generation=0),
            *(progress(5.0 + i, 1 + 10 * i) for i in range(1, 10)), progress(15.0, 100),
            ev("finished", 20.5, recoveries=0)]


def test_clean_run_is_startup_productive_and_shutdown() -> None:
    goodput = goodput_from_events(clean_events(), T0, T0 + 21.0, trained_until=T0 + 19.0,
                                  final_step=100)
    assert_sums(goodput)
    assert goodput.wall_s == pytest.approx(21.0)
    assert goodput.startup_s == pytest.approx(5.0)        # launch -> every rank past step 1
    assert goodput.shutdown_s == pytest.approx(2.0)       # training ended -> summary written
    assert goodput.productive_s == pytest.approx(14.0)
    assert goodput.redone_s == 0 and goodput.recovery_s == {} and goodput.recoveries == 0
    assert goodput.effective == pytest.approx(14.0 / 21.0)
    assert goodput.steps_computed == 99 and goodput.mean_step_s == pytest.approx(14.0 / 99)
    assert not goodput.snapshot_stall_reported and goodput.snapshot_stall_s == 0
    assert "snapshot stall not reported" in summary_line(goodput.to_json())


def test_without_trained_until_a_finished_run_ends_training_at_the_last_sample() -> None:
    goodput = goodput_from_events(clean_events(), T0, T0 + 21.0)
    assert_sums(goodput)
    assert goodput.shutdown_s == pytest.approx(6.0)       # last progress at +15
    assert goodput.steps_computed == 99                   # final step from the samples


def recovery_events(stall: float | None = 0.5) -> list[dict[str, Any]]:
    extra = {} if stall is None else {"snapshot_stall_s": stall}
    return [
        ev("started", 1.0), ev("first_step", 4.0, step=1, generation=0),
        progress(6.0, 20, **extra), progress(9.5, 54, **extra),
        ev("fault", 10.0, kind="worker_died", ranks=[1]),
        *phases((10.0, "steady", "detecting"), (10.01, "detecting", "planning"),
                (10.03, "planning", "fencing"), (10.06, "fencing", "promoting"),
                (10.1, "promoting", "restoring")),
        ev("plan", 10.02, generation=1, restore_step=50),
        # the ranks stepped again at +11.2; the coordinator saw it at +11.5
        *phases((11.5, "restoring", "resuming"), (11.5, "resuming", "steady")),
        ev("recovered", 11.5, generation=1, restore_step=50, lost_steps=5, first_step_at=T0 + 11.2,
           fault_to_first_step_s=1.205, phases_s={"detect": 0.005, "detecting": 0.01}),
        progress(12.0, 56, 1, **extra), progress(20.0, 130, 1, **extra),
        ev("finished", 21.0, recoveries=1)]


def test_a_recovery_is_split_into_its_phases_and_the_rollback_is_redone() -> None:
    goodput = goodput_from_events(recovery_events(), T0, T0 + 22.0, trained_until=T0 + 20.5,
                                  final_step=130)
    assert_sums(goodput)
    assert goodput.recoveries == 1 and goodput.lost_steps == 5
    assert goodput.recovery_s == pytest.approx({
        "detect": 0.005, "detecting": 0.01, "planning": 0.02, "fencing": 0.03,
        "promoting": 0.04, "restoring": 1.1})   # restoring ends at the ranks' first step
    assert goodput.startup_s == pytest.approx(4.0) and goodput.shutdown_s == pytest.approx(1.5)
    training = 22.0 - 4.0 - 1.5 - sum(goodput.recovery_s.values())
    assert goodput.snapshot_stall_reported and goodput.snapshot_stall_s == pytest.approx(0.5)
    # steps computed: 1 -> 130, 5 of them twice, the first step of generation 1 in "restoring"
    assert goodput.steps_computed == 130 - 1 + 5 - 1
    assert goodput.mean_step_s == pytest.approx((training - 0.5) / 133)
    assert goodput.redone_s == pytest.approx(5 * goodput.mean_step_s)
    assert goodput.productive_s == pytest.approx(training - 0.5 - goodput.redone_s)


def test_waiting_for_capacity_is_its_own_part() -> None:
    events = [
        ev("first_step", 2.0, step=1), progress(5.0, 30),
        *phases((6.0, "steady", "detecting"), (6.01, "detecting", "planning"),
                (6.02, "planning", "degraded")),
        ev("waiting_for_capacity", 6.02, reason="no spare", spares_needed=1),
        *phases((14.02, "degraded", "detecting"), (14.03, "detecting", "planning"),
                (14.04, "planning", "fencing"), (14.05, "fencing", "promoting"),
                (14.06, "promoting", "restoring"), (15.0, "restoring", "resuming"),
                (15.0, "resuming", "steady")),
        ev("recovered", 15.0, generation=1, restore_step=30, lost_steps=0,
           first_step_at=T0 + 14.9, fault_to_first_step_s=8.9, phases_s={"detect": 0.0}),
        progress(20.0, 80, 1), ev("finished", 21.0)]
    goodput = goodput_from_events(events, T0, T0 + 22.0, trained_until=T0 + 20.0, final_step=80)
    assert_sums(goodput)
    assert goodput.waiting_for_capacity_s == pytest.approx(8.0)
    assert goodput.recovery_s["detecting"] == pytest.approx(0.02)   # both visits
    assert goodput.recovery_s["planning"] == pytest.approx(0.02)
    assert goodput.recovery_s["restoring"] == pytest.approx(0.84)
    assert goodput.redone_s == 0


def test_a_failed_run_ends_training_at_the_failure() -> None:
    events = [ev("first_step", 3.0, step=1), progress(8.0, 40),
              *phases((9.0, "steady", "detecting"), (9.01, "detecting", "planning"),
                      (9.02, "planning", "failed")),
              ev("job_failed", 9.03, error_type="PlanInfeasible", message="no spare")]
    goodput = goodput_from_events(events, T0, T0 + 11.0)
    assert_sums(goodput)
    assert goodput.shutdown_s == pytest.approx(11.0 - 9.02)
    assert goodput.recovery_s == pytest.approx({"detecting": 0.01, "planning": 0.01})
    assert goodput.productive_s == pytest.approx(9.0 - 3.0)


def test_a_run_that_never_trained_is_all_startup_and_shutdown() -> None:
    goodput = goodput_from_events([ev("job_failed", 4.0, error_type="WorkerFailed")], T0, T0 + 5)
    assert_sums(goodput)
    assert (goodput.startup_s, goodput.shutdown_s, goodput.productive_s) == \
        pytest.approx((4.0, 1.0, 0.0))
    assert goodput.effective == 0


def test_a_live_run_trains_until_now_with_no_shutdown() -> None:
    events = [ev("first_step", 3.0, step=1), progress(5.0, 20), progress(7.0, 40)]
    goodput = goodput_from_events(events, T0, T0 + 8.0)
    assert_sums(goodput)
    assert goodput.shutdown_s == 0 and goodput.productive_s == pytest.approx(5.0)


def test_older_runs_without_first_step_use_the_first_progress_past_step_one() -> None:
    events = [progress(3.0, 0), progress(4.0, 3), progress(9.0, 50), ev("finished", 10.0)]
    goodput = goodput_from_events(events, T0, T0 + 10.0, trained_until=T0 + 9.5, final_step=50)
    assert_sums(goodput)
    assert goodput.startup_s == pytest.approx(4.0) and goodput.steps_computed == 47


def test_recovery_phases_beat_startup_and_shutdown_beats_nothing() -> None:
    windows = [Window("startup", 0, 10), Window("recovery", 8, 12, "restoring"),
               Window("shutdown", 18, 20), Window("training", 11, 12)]
    goodput = account(0.0, 20.0, windows, steps_computed=10)
    assert_sums(goodput)
    assert goodput.startup_s == 8 and goodput.recovery_s == {"restoring": 3}
    assert goodput.shutdown_s == 2 and goodput.productive_s == 7


def test_widened_adds_startup_and_shutdown() -> None:
    goodput = goodput_from_events(clean_events(), T0, T0 + 21.0, trained_until=T0 + 19.0)
    wide = goodput.widened(1.5, 0.5)
    assert_sums(wide)
    assert wide.wall_s == pytest.approx(23.0) and wide.startup_s == pytest.approx(6.5)
    assert wide.productive_s == goodput.productive_s


def test_json_and_texts_name_every_part() -> None:
    doc = goodput_from_events(recovery_events(), T0, T0 + 22.0, trained_until=T0 + 20.5).to_json()
    assert {"wall_s", "effective", "startup_s", "productive_s", "redone_s", "snapshot_stall_s",
            "recovery_s", "waiting_for_capacity_s", "shutdown_s", "sum_s", "redone_from",
            "snapshot_stall_reported"} <= set(doc)
    assert json.loads(json.dumps(doc)) == doc
    line = summary_line(doc)
    assert line.startswith("goodput ") and "restoring" in line and "productive" in line
    table = "\n".join(markdown_breakdown(doc))
    assert "| recovery: restoring |" in table and "| **sum** |" in table


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["training", "recovery", "waiting_for_capacity",
                                           "startup", "shutdown"]),
                          st.floats(-5, 105), st.floats(0, 50)), max_size=30),
       st.integers(0, 500), st.integers(0, 50), st.one_of(st.none(), st.floats(0, 200)))
def test_the_parts_always_sum_to_the_wall_time(raw: list[tuple[str, float, float]], steps: int,
                                               lost: int, stall: float | None) -> None:
    windows = [Window(kind, start, start + length, "p" if kind == "recovery" else "")
               for kind, start, length in raw]
    assert_sums(account(0.0, 100.0, windows, steps_computed=steps, lost_steps=lost,
                        snapshot_stall_s=stall))


def test_the_summary_is_written_atomically_and_read_back(tmp_path: Path) -> None:
    summary = build_summary("finished", "demo", 4, recovery_events(), T0, T0 + 22.0,
                            generation=1, committed_step=120, final_step=130,
                            trained_until=T0 + 20.5)
    assert summary["outcome"] == "finished" and summary["steps"] == 130
    assert summary["recoveries"] == 1 and summary["recovery_history"][0]["lost_steps"] == 5
    assert summary["wall_s"] == pytest.approx(22.0)
    assert abs(summary["goodput"]["sum_s"] - summary["wall_s"]) <= 0.01 * summary["wall_s"]
    write_summary(tmp_path, summary)
    assert read_summary(tmp_path) == summary
    assert not list(tmp_path.glob(".*tmp"))
    assert read_summary(tmp_path / "missing") is None


def test_a_dead_run_is_reconstructed_from_its_events(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text(json.dumps({"job": "demo", "world_size": 4,
                                                   "started_at": T0}))
    lines = [json.dumps(e) for e in recovery_events()[:-2]]   # killed before it finished
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + '\n{"event": "progr')
    summary = reconstruct(tmp_path)
    assert summary["outcome"] == "dead" and summary["reconstructed"]
    assert summary["steps"] == 56 and summary["recoveries"] == 1
    assert summary["wall_s"] == pytest.approx(12.0)            # up to the last event
    goodput = summary["goodput"]
    assert goodput["shutdown_s"] == pytest.approx(0.0)
    assert abs(goodput["sum_s"] - goodput["wall_s"]) <= 0.01 * goodput["wall_s"]


def test_a_launch_attempt_ray_lost_before_its_coordinator_is_summarised(tmp_path: Path) -> None:
    """The launcher starts the job again in a new run directory; the lost attempt's own
    directory says why (before, it had no summary.json and read as a dead launcher's run:
    a test counting run directories miscounted)."""
    from phalanx.launcher.job import StartupLost
    from phalanx.launcher.run_summary import record_startup_lost

    record_startup_lost(tmp_path, "demo", 2, time.time() - 5, StartupLost("Ray lost 1 node"))
    summary = read_summary(tmp_path)
    assert summary is not None and summary["outcome"] == "failed"
    assert summary["error"] == {"type": "StartupLost", "message": "Ray lost 1 node"}
