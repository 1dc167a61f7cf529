"""The drill report: faults matched with their detection and recovery, expectation rows,
and the json/md/png files. ``data/drill_demo_events.jsonl`` is the events.jsonl of a real
demo drill (kill_worker of rank 1 at step 20, recovered onto spare0 losing 1 step); it
predates ``progress`` and ``rank_restored`` events, which ``_demo_events`` adds."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pytest

from phalanx.launcher.drills.plot import phase_spans
from phalanx.launcher.drills.report import (JSON_NAME, MD_NAME, PNG_NAME, RunOutcome, build_report,
                                            console_rows, write_report)
from phalanx.launcher.events import read_events
from phalanx.launcher.drills.catalogue import FaultSpec

pytestmark = pytest.mark.unit
DEMO = Path(__file__).parent / "data" / "drill_demo_events.jsonl"
HASH_A, HASH_B = "a" * 64, "b" * 64
T0 = 1_000.0


@dataclass(frozen=True)
class _Scenario:
    """What the report reads of ``phalanx.launcher.drills.scenario.Scenario``."""

    name: str
    faults: tuple[FaultSpec, ...]
    expect: Mapping[str, Any] = field(default_factory=dict)
    description: str = "a test drill"


def _demo_events() -> list[dict[str, Any]]:
    events = read_events(DEMO)
    start = events[0]["time"]
    end = events[-1]["time"]
    ticks = int((end - start) / 0.5)
    events += [{"event": "progress", "time": start + 0.5 * i, "min_step": i, "max_step": i + 1,
                "generation": 0 if i < 30 else 1} for i in range(ticks)]
    restored = events[0]["time"] + 15.5
    events += [{"event": "rank_restored", "time": restored, "rank": r, "generation": 1,
                "step": 24, "source": f"keeper node{r % 2}",
                "source_kind": "replica" if r == 1 else "own", "bytes": 51272, "seconds": 0.01}
               for r in range(4)]
    return events


def _demo_scenario(**expect: Any) -> _Scenario:
    return _Scenario("kill_worker", (FaultSpec("kill_worker", index=0, rank=1, at_step=20),),
                     expect)


def _ok(seconds: float = 21.0, hashes: dict[int, str] | None = None) -> RunOutcome:
    return RunOutcome(0, hashes if hashes is not None else {0: HASH_A, 1: HASH_A},
                      Path("/runs/x"), "", seconds)


def _kill(step: int, at: float, rank: int, generation: int, lost: int) -> list[dict[str, Any]]:
    """One kill of ``rank`` at ``at`` s, detected 0.1 s later, first step 1 s after it."""
    t = T0 + at
    return [
        {"event": "drill_fault", "time": t, "index": generation - 1, "kind": "kill_worker",
         "target": f"rank {rank}", "trigger": f"at step {step}", "step": step,
         "details": {"pids": [100 + rank]}},
        {"event": "fault", "time": t + 0.1, "kind": "worker_died", "ranks": [rank],
         "node": "node0", "evidence": "actor died"},
        {"event": "promoted", "time": t + 0.3, "rank": rank, "worker": f"w{rank}-g{generation}",
         "node": "node0", "generation": generation},
        {"event": "recovered", "time": t + 1.1, "generation": generation, "first_step_at": t + 1.0,
         "restore_step": step - lost, "lost_steps": lost, "fault": "worker_died", "ranks": [rank],
         "phases_s": {"detect": 0.1, "planning": 0.1, "restoring": 0.5}}]


def _started() -> dict[str, Any]:
    return {"event": "started", "time": T0, "world_size": 2, "nodes": 1, "spares": 0}


def _row(report: Mapping[str, Any], check: str) -> dict[str, Any]:
    return next(r for r in report["checks"] if r["check"] == check)


def test_demo_run_matches_the_kill_with_its_detection_and_recovery() -> None:
    scenario = _demo_scenario(max_recovery_s=5, max_lost_steps=1, final_state="identical",
                              recoveries=1, restore_source="replica", detected="worker_died")
    report = build_report(scenario, _ok(), {0: HASH_A, 1: HASH_A}, "fault-free run /r",
                          _demo_events())
    (fault,) = report["faults"]
    assert (fault["kind"], fault["target"], fault["trigger"]) == ("kill_worker", "rank 1",
                                                                 "at step 20")
    assert fault["step"] == 22 and fault["details"] == {"node": None, "pids": [25381], "rank": 1}
    assert fault["at_s"] == pytest.approx(15.101, abs=1e-3)
    assert fault["detection_s"] == pytest.approx(0.119, abs=5e-3)
    assert fault["detected"]["kind"] == "worker_died"
    rec = fault["recovery"]
    assert fault["recovery_s"] == rec["recovery_s"] == pytest.approx(0.389, abs=1e-3)
    assert (rec["generation"], rec["restore_step"], rec["lost_steps"]) == (1, 24, 1)
    assert rec["spare_used"] and rec["promotions"][0]["worker"] == "spare0"
    assert rec["phases_s"]["restoring"] == pytest.approx(0.3367)
    assert list(rec["phases_s"]) == ["detect", "detecting", "planning", "fencing", "promoting",
                                     "restoring", "resuming"]
    assert {r["rank"]: r["source_kind"] for r in rec["restores"]} == {
        0: "own", 1: "replica", 2: "own", 3: "own"}
    assert rec["bytes_moved"] == 4 * 51272
    assert rec["restores"][0]["gb_per_s"] == pytest.approx(51272 / 0.01 / 1e9, abs=1e-3)
    assert rec["actions"][0] == "PromoteSpare"
    assert report["passed"], [r["text"] for r in report["checks"]]
    assert [h["verdict"] for h in report["final_state"]] == ["identical", "identical"]
    assert report["timeline"][2] == [1.0, 2, 3]
    assert report["event_counts"]["tier_persisted"] == 6


def test_demo_report_files_are_written(tmp_path: Path) -> None:
    report = build_report(_demo_scenario(max_lost_steps=1), _ok(), None, "", _demo_events())
    paths = write_report(report, tmp_path)
    assert paths == [tmp_path / JSON_NAME, tmp_path / MD_NAME, tmp_path / PNG_NAME]
    loaded = json.loads(paths[0].read_text())
    assert loaded["png"] == PNG_NAME and loaded["faults"][0]["recovery"]["lost_steps"] == 1
    markdown = paths[1].read_text()
    assert "| check | expected | measured | result |" in markdown
    assert "| lost steps | <= 1 | 1 | **PASS** |" in markdown
    assert "spare0 on node0 (warm spare)" in markdown and "# Drill `kill_worker`: PASS" in markdown
    assert paths[2].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert not list(tmp_path.glob(".*.tmp"))


def test_old_run_without_progress_or_restores_still_reports(tmp_path: Path) -> None:
    report = build_report(_demo_scenario(), _ok(), None, "", read_events(DEMO))
    rec = report["faults"][0]["recovery"]
    assert rec["restores"] == [] and rec["bytes_moved"] == 0 and report["timeline"] == []
    assert report["passed"]
    assert len(write_report(report, tmp_path)) == 3


def test_broken_expectation_fails_with_expected_and_measured() -> None:
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=4)]
    scenario = _Scenario("lossy", (FaultSpec("kill_worker", rank=1, at_step=10),),
                         {"max_lost_steps": 0})
    report = build_report(scenario, _ok(), None, "", events)
    row = _row(report, "lost steps")
    assert not report["passed"] and not row["ok"]
    assert row["text"] == "lost steps: expected <= 0, measured 4 -> FAIL"
    assert ("lost steps", "<= 0", "4", "FAIL") in console_rows(report)
    assert not report["faults"][0]["recovery"]["spare_used"]   # a fresh worker, not a spare


def test_final_state_identical_fails_on_different_hashes_or_no_reference() -> None:
    scenario = _Scenario("state", (FaultSpec("kill_worker", rank=1, at_step=10),),
                         {"final_state": "identical"})
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=0)]
    drilled = _ok(hashes={0: HASH_A, 1: HASH_B})
    differs = build_report(scenario, drilled, {0: HASH_A, 1: HASH_A}, "cached reference /c", events)
    assert _row(differs, "final state")["measured"] == "DIFFERENT (ranks 1)"
    assert not differs["passed"]
    assert [h["verdict"] for h in differs["final_state"]] == ["identical", "DIFFERENT"]
    missing = build_report(scenario, drilled, None, "", events)
    assert _row(missing, "final state")["measured"] == "no reference"
    assert not missing["passed"] and missing["final_state"][0]["verdict"] == "no reference"
    keys_as_text = build_report(scenario, drilled, {"0": HASH_A, "1": HASH_B}, "", events)
    assert keys_as_text["passed"]            # a reference read back from JSON has str keys


@pytest.mark.parametrize(("error", "passed"), [
    ("job failed: PlanInfeasible: no spare and no restart budget", True),
    ("job failed: SparePoolExhausted: none left", False)])
def test_expected_failure_checks_the_error(error: str, passed: bool) -> None:
    scenario = _Scenario("doomed", (FaultSpec("kill_node", node=1, at_step=5),),
                         {"outcome": "fails", "error_contains": "PlanInfeasible"})
    events = [_started(),
              {"event": "drill_fault", "time": T0 + 1, "index": 0, "kind": "kill_node",
               "target": "node1", "trigger": "at step 5", "step": 5, "details": {}},
              {"event": "fault", "time": T0 + 1.2, "kind": "node_died", "ranks": [2, 3],
               "node": "node1", "evidence": "gone"},
              {"event": "job_failed", "time": T0 + 1.5, "error_type": "PlanInfeasible",
               "message": "no spare"}]
    report = build_report(scenario, RunOutcome(1, {}, None, error, 3.0), None, "", events)
    row = _row(report, "job outcome")
    assert report["passed"] is passed and row["ok"] is passed
    assert row["expected"] == "exit != 0, error contains 'PlanInfeasible'"
    assert row["measured"] == f"exit 1: {error}"
    assert report["run"]["job_failed"]["error_type"] == "PlanInfeasible"
    assert report["faults"][0]["no_recovery"].startswith(
        "no recovery: node_died was detected but no new generation followed; the job failed")


def test_a_failed_run_fails_the_default_outcome() -> None:
    report = build_report(_Scenario("x", ()), RunOutcome(2, {}, None, "job failed: boom"), None,
                          "", [])
    assert _row(report, "job outcome")["text"] == (
        "job outcome: expected exit 0, measured exit 2: job failed: boom -> FAIL")


def test_a_straggler_needs_no_recovery() -> None:
    scenario = _Scenario("slow", (FaultSpec("slow_worker", rank=0, at_step=5,
                                            params={"for_s": 2.0}),),
                         {"recoveries": 0, "max_recovery_s": 1})
    events = [_started(),
              {"event": "drill_fault", "time": T0 + 1, "index": 0, "kind": "slow_worker",
               "target": "rank 0", "trigger": "at step 5", "step": 5, "details": {"for_s": 2}},
              {"event": "drill_fault_end", "time": T0 + 3, "index": 0, "kind": "slow_worker"},
              {"event": "finished", "time": T0 + 9, "recoveries": 0}]
    report = build_report(scenario, _ok(), None, "", events)
    (fault,) = report["faults"]
    assert fault["recovery"] is None and fault["detection_s"] is None
    assert fault["no_recovery"].startswith("no recovery: none needed")
    assert fault["ended_at_s"] == 3.0
    assert _row(report, "recoveries")["ok"] and report["passed"]
    assert _row(report, "recovery time (s)")["measured"] == "no recovery needed"


def test_a_detected_fault_that_never_recovers_measures_never() -> None:
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=0)[:2]]
    scenario = _Scenario("stuck", (FaultSpec("kill_worker", rank=1, at_step=10),),
                         {"max_recovery_s": 30})
    report = build_report(scenario, _ok(), None, "", events)
    assert _row(report, "recovery time (s)")["text"] == (
        "recovery time (s): expected <= 30, measured never -> FAIL")


def test_faults_at_different_steps_get_their_own_recoveries() -> None:
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=1),
              *_kill(step=30, at=8.0, rank=0, generation=2, lost=2),
              {"event": "keeper_started", "time": T0 + 9}]
    specs = (FaultSpec("kill_worker", rank=1, at_step=10),
             FaultSpec("kill_worker", index=1, rank=0, at_step=30))
    report = build_report(_Scenario("two", specs, {"max_recovery_s": 1.5}), _ok(), None, "",
                          events)
    assert [f["recovery"]["generation"] for f in report["faults"]] == [1, 2]
    assert [f["recovery_s"] for f in report["faults"]] == [1.0, 1.0]
    assert report["passed"] and report["event_counts"]["keeper_started"] == 1
    assert [r["lost_steps"] for r in report["recoveries"]] == [1, 2]


def test_faults_at_the_same_step_share_one_recovery() -> None:
    first = _kill(step=10, at=2.0, rank=1, generation=1, lost=0)
    second = {**first[0], "time": T0 + 2.01, "index": 1, "target": "rank 0"}
    first[-1]["ranks"] = [0, 1]
    events = [_started(), first[0], second, *first[1:]]
    report = build_report(_Scenario("pair", ()), _ok(), None, "", events)
    assert [f["recovery"]["generation"] for f in report["faults"]] == [1, 1]
    assert [f["recovery_s"] for f in report["faults"]] == [1.0, 0.99]
    assert [s[0] for s in phase_spans(report["faults"])] == ["detect", "planning", "restoring"]


def test_a_probabilistic_fault_may_not_fire() -> None:
    spec = FaultSpec("kill_worker", rank=1, probability=0.1, steps=(5, 9), seed=3)
    report = build_report(_Scenario("maybe", (spec,)), _ok(), None, "", [_started()])
    assert _row(report, "every fault fired")["expected"] == "probabilistic"
    assert report["passed"]


def test_unfired_fault_fails() -> None:
    spec = FaultSpec("kill_worker", rank=1, at_step=500)
    report = build_report(_Scenario("late", (spec,)), _ok(), None, "", [_started()])
    assert _row(report, "every fault fired")["text"] == (
        "every fault fired: expected 1, measured 0 -> FAIL")


def test_a_fault_whose_injection_raised_did_not_fire() -> None:
    spec = FaultSpec("hang_worker", rank=2, at_step=20)
    refused = {"event": "drill_fault", "time": T0 + 1, "index": 0, "kind": "hang_worker",
               "step": 20, "details": {"error": "ConfigError: rank 2 has no running worker"}}
    report = build_report(_Scenario("aimless", (spec,)), _ok(), None, "", [_started(), refused])
    assert _row(report, "every fault fired")["text"] == (
        "every fault fired: expected 1, measured 0 -> FAIL")
    assert not report["passed"]


def test_restore_source_and_detected_rows() -> None:
    scenario = _demo_scenario(restore_source="s3", detected="silent_corruption")
    report = build_report(scenario, _ok(), None, "", _demo_events())
    assert _row(report, "restore source")["measured"] == "own, replica"
    assert _row(report, "detected")["text"] == (
        "detected: expected silent_corruption, measured worker_died -> FAIL")


def test_without_matplotlib_the_png_is_skipped(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    report = build_report(_demo_scenario(), _ok(), None, "", _demo_events())
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == [JSON_NAME, MD_NAME]
    loaded = json.loads((tmp_path / JSON_NAME).read_text())
    assert loaded["png"] is None and "matplotlib" in loaded["png_missing"]
    assert not (tmp_path / PNG_NAME).exists()


def test_goodput_comes_from_the_summary_or_else_from_the_events(tmp_path: Path) -> None:
    from phalanx.launcher.run_summary import build_summary

    events = _demo_events()
    summary = build_summary("finished", "demo", 4, events, events[0]["time"] - 2.0,
                            events[-1]["time"] + 1.0, final_step=60)
    report = build_report(_demo_scenario(), _ok(), None, "", events, summary)
    goodput = report["goodput"]
    assert goodput["source"] == "summary.json" and goodput["recoveries"] == 1
    assert abs(goodput["sum_s"] - goodput["wall_s"]) <= 0.01 * goodput["wall_s"]
    write_report(report, tmp_path)
    markdown = (tmp_path / MD_NAME).read_text()
    assert "| goodput | goodput " in markdown and "## Goodput" in markdown
    assert "| **sum** |" in markdown
    assert json.loads((tmp_path / JSON_NAME).read_text())["goodput"]["wall_s"] == goodput["wall_s"]
    fallback = build_report(_demo_scenario(), _ok(), None, "", events)["goodput"]
    assert fallback["source"].startswith("events.jsonl")
    assert abs(fallback["sum_s"] - fallback["wall_s"]) <= 0.01 * fallback["wall_s"]


def test_a_recovery_says_when_its_new_workers_were_running() -> None:
    from phalanx.launcher.drills.commands import _fault_line
    from phalanx.launcher.drills.report import render_markdown

    scenario = _Scenario("cold", (FaultSpec("kill_worker", rank=1, at_step=10),))
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=0)]
    events[-1]["workers_up_at"] = T0 + 2.0 + 0.75      # the fresh worker registered
    (fault,) = build_report(scenario, _ok(), None, "", events)["faults"]
    assert fault["recovery"]["workers_up_s"] == 0.75 and fault["recovery_s"] == 1.0
    assert "(new workers running after 0.750 s)" in _fault_line(fault)
    assert "- new workers running 0.75 s after injection" in render_markdown(
        build_report(scenario, _ok(), None, "", events))
    del events[-1]["workers_up_at"]                       # a recovery that started none
    (fault,) = build_report(scenario, _ok(), None, "", events)["faults"]
    assert fault["recovery"]["workers_up_s"] is None
    assert "new workers" not in _fault_line(fault)


def test_the_time_after_new_workers_ran_is_checked_apart_from_their_start_up() -> None:
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=0)]
    events[-1]["workers_up_at"] = T0 + 2.0 + 0.75      # first step 1.0 s after the kill

    def row(limit: float) -> dict[str, Any]:
        scenario = _Scenario("cold", (FaultSpec("kill_worker", rank=1, at_step=10),),
                             {"max_after_workers_up_s": limit, "max_recovery_s": 2})
        return _row(build_report(scenario, _ok(), None, "", events),
                    "after new workers ran (s)")

    assert row(0.3)["measured"] == 0.25 and row(0.3)["ok"]
    assert not row(0.2)["ok"]
    del events[-1]["workers_up_at"]           # no new worker: the whole recovery counts
    assert row(0.3)["measured"] == 1.0 and not row(0.3)["ok"]


def test_a_spare_promoted_while_warming_is_named_so() -> None:
    from phalanx.launcher.drills.report import render_markdown

    scenario = _Scenario("warming", (FaultSpec("kill_worker", rank=1, at_step=10),))
    events = [_started(), *_kill(step=10, at=2.0, rank=1, generation=1, lost=0)]
    events[3].update(worker="spare3", warming=True)      # the promoted event
    report = build_report(scenario, _ok(), None, "", events)
    (promotion,) = report["faults"][0]["recovery"]["promotions"]
    assert promotion["spare"] and promotion["warming"]
    assert "rank 1 <- spare3 on node0 (spare still warming up)" in render_markdown(report)
