"""The pure parts of bench/vs_torchrun.py's torchft peer and of its start-up / steady-state
split: windows and step figures, torchft's recovery read from progress records (heal,
degraded steps, phases), the summary, ratios, targets and tables that carry them, and a
torchft that is not installed recorded as a failed run."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import torchft_run, vs_torchft
from bench.vs_torchrun import parse_args, snapshot_config, steps_of
from bench.vs_torchrun_goodput import torchrun_goodput
from bench.vs_torchrun_report import markdown, ratios_of, summarize, targets_of
from bench.vs_torchrun_steps import (capture_window, step_figures, steady_window,
                                     warmup_end)

pytestmark = pytest.mark.unit
KILL = 2.45


def test_the_steady_window_starts_after_the_warm_up_and_holds_whole_save_intervals() -> None:
    assert warmup_end(200, 174) == 40                   # the first 20% of the run
    assert steady_window(200, 174) == (74, 174)         # 100 steps: two k=50 saves, ten k=10
    assert capture_window(174) == (124, 174)            # the last 50, as the bench had it
    assert steady_window(32, 24) == (14, 24)            # --quick: 10 steps after warm-up 7
    assert steady_window(10, 4) == (3, 4)               # tiny runs: still before the fault
    assert capture_window(24) == (3, 24)


def test_step_figures_keep_start_up_and_warm_up_out_of_the_steady_state() -> None:
    # launch at 0, step 0 done at 5 s; steps 1..39 take 0.3 s (first captures), then 0.1 s
    ends, t = [(0, 5.0)], 5.0
    for step in range(1, 200):
        t += 0.3 if step < 40 else 0.1
        ends.append((step, t))
    figures = step_figures(ends, [5.0, 4.8], 0.0, 200, 174)
    assert figures["startup_s"] == 5.0
    assert figures["warmup_step_s"] == pytest.approx(0.3)
    assert figures["steady_step_s"] == pytest.approx(0.1)
    assert figures["window_step_s"] == pytest.approx(0.1)
    assert step_figures(ends, [5.0, None], 0.0, 200, 174)["startup_s"] is None


def _records() -> dict[int, list[dict[str, Any]]]:
    """Group 1 killed after step 24 (t 2.45); restarted at 3.0, imported by 5.0, Manager
    built at 6.0, healed at 7.5; the heal step 25 ran with one group (n=1)."""
    def step(s: int, t: float, n: int = 2, attempt: int = 0) -> dict[str, Any]:
        return {"event": "step", "step": s, "t": t, "n": n, "attempt": attempt}
    survivor = [{"event": "start", "attempt": 0, "t": -1.0, "since_exec_s": 1.0, "pid": 10}]
    survivor += [step(s, 0.1 * s) for s in range(25)]
    survivor += [step(25, 7.6, n=1)] + [step(s, 7.6 + 0.1 * (s - 25)) for s in range(26, 32)]
    survivor.append({"event": "done", "attempt": 0, "t": 8.5, "hash": "h", "step": 32})
    killed = [{"event": "start", "attempt": 0, "t": -1.0, "since_exec_s": 1.0, "pid": 11}]
    killed += [step(s, 0.1 * s) for s in range(25)]
    again = [{"event": "start", "attempt": 1, "t": 5.0, "since_exec_s": 2.0, "pid": 12},
             {"event": "joined", "attempt": 1, "t": 6.0},
             {"event": "healed", "attempt": 1, "t": 7.5, "seconds": 0.01},
             step(25, 7.61, n=1, attempt=1)]
    again += [step(s, 7.6 + 0.1 * (s - 25), attempt=1) for s in range(26, 32)]
    again.append({"event": "done", "attempt": 1, "t": 8.5, "hash": "h", "step": 32})
    return {0: survivor, 1: killed + again}


def test_torchft_recovery_reads_the_heal_the_phases_and_the_degraded_steps() -> None:
    found, errors = vs_torchft.torchft_recovery(_records(), KILL, 25, 1, 2)
    assert errors == []
    assert found["resume_step"] == 25 and found["lost_steps"] == 0   # no rollback
    assert found["degraded_steps"] == 1 and found["healed"] is True
    assert found["kill_to_first_step_s"] == pytest.approx(7.61 - KILL)
    assert found["survivor_stall_s"] == pytest.approx(7.6 - KILL)
    assert found["kill_to_regained_s"] == pytest.approx(7.61 - KILL)
    phases = found["phases"]
    assert list(phases) == ["restart", "import", "init", "heal", "first_step"]
    assert phases["restart"] == pytest.approx(3.0 - KILL) and phases["heal"] == 1.5
    assert sum(phases.values()) == pytest.approx(found["kill_to_first_step_s"], abs=1e-3)


def test_torchft_goodput_accounts_its_own_recovery_phases() -> None:
    records = _records()
    found, _ = vs_torchft.torchft_recovery(records, KILL, 25, 1, 2)
    result = {"killed_at": KILL, "lost_steps": 0, **found}
    goodput = torchrun_goodput(records, -2.0, 9.0, result, 32)
    assert set(goodput["recovery_s"]) == {"restart", "import", "init", "heal", "first_step"}
    assert sum(goodput["recovery_s"].values()) == pytest.approx(7.61 - KILL, abs=1e-3)
    parts = (goodput["startup_s"] + goodput["productive_s"] + goodput["redone_s"]
             + goodput["snapshot_stall_s"] + goodput["shutdown_s"]
             + goodput["waiting_for_capacity_s"] + sum(goodput["recovery_s"].values()))
    assert parts == pytest.approx(11.0, abs=0.01)


def test_a_group_never_restarted_is_an_error_not_a_figure() -> None:
    records = _records()
    records[1] = [r for r in records[1] if r["attempt"] == 0]
    found, errors = vs_torchft.torchft_recovery(records, KILL, 25, 1, 2)
    assert found == {} and "never restarted" in errors[0]


def test_differs_because_names_the_degraded_steps() -> None:
    line = vs_torchft.differs_because({"identical_to_fault_free": False, "degraded_steps": 3})
    assert line is not None and "3 step(s)" in line and "one group's gradient" in line
    assert vs_torchft.differs_because({"identical_to_fault_free": True}) is None


def _run(system: str, **fields: Any) -> dict[str, Any]:
    base = {"system": system, "job": "mlp", "world": 2, "purpose": "main", "ok": True,
            "wall_s": 10.0, "startup_s": 5.0, "warmup_step_s": 0.06, "steady_step_s": 0.05,
            "window_step_s": 0.05, "bytes_written": 0, "peak_host_memory_bytes": 2**30,
            "hash": "ref", "goodput": None}
    return {**base, **fields}


def test_summary_ratios_targets_and_tables_carry_torchft_and_the_start_up_split() -> None:
    runs = [_run("torchrun"),
            _run("torchft", startup_s=7.0, steady_step_s=0.055, window_step_s=0.06,
                 kill_to_first_step_s=5.0, lost_steps=0, degraded_steps=1, hash="other",
                 identical_to_fault_free=False,
                 differs_because="the survivor committed 1 step(s) alone"),
            _run("phalanx", startup_s=20.0, steady_step_s=0.051, kill_to_first_step_s=0.25,
                 lost_steps=0, peak_host_memory_bytes=3 * 2**30)]
    labels = {"torchrun": "torchrun", "torchft": "torchft 0.2.0", "phalanx": "phalanx"}
    summary = summarize(runs, labels, {"mlp": "ref"})
    cells = summary["mlp"]
    assert cells["torchft"]["overhead"] == pytest.approx(0.1)
    assert cells["torchft"]["window_overhead"] == pytest.approx(0.2)
    assert cells["phalanx"]["startup_s"] == 20.0 and cells["torchft"]["degraded_steps"] == 1
    assert cells["torchft"]["identical_to_fault_free"] is False
    assert cells["phalanx"]["identical_to_fault_free"] is True
    ratios = ratios_of(summary)["mlp"]["torchft"]
    assert ratios["kill_to_first_step_s"] == pytest.approx(0.05)
    assert ratios["startup_s"] == pytest.approx(20 / 7, abs=1e-3)
    targets = {t["target"]: t for t in targets_of(summary)}
    versus = targets["phalanx recovers faster than torchft, bit-identical"]
    assert versus["verdict"] == "PASS" and versus["measured"]["torchft_identical"] is False
    assert targets["phalanx peak memory <= 1.5x torchrun's"]["verdict"] == "MISS"
    assert targets["phalanx steady-state overhead <= 3%"]["verdict"] == "PASS"
    report = {"quick": True, "machine": {"cpus": 2}, "repeats": 1, "transformer_repeats": 1,
              "target_rank": 1, "summary": summary, "ratios": ratios_of(summary),
              "targets": targets_of(summary), "scaling": [], "runs": runs,
              "jobs": {"mlp": {"world": 2, "state_mib": 0.04, "steps": 200, "fault_step": 174,
                               "warmup_end": 40, "steady_window": [74, 174],
                               "capture_window": [124, 174]}}}
    text = markdown(report)
    assert "| torchft 0.2.0 | 10 | 7 | 60 | 55 | +10.0% | 60 | +20.0% |" in text
    assert "degraded steps" in text and "params differ because the survivor" in text
    assert "steady state = mean step over steps 74..173" in text


def test_without_phalanx_there_is_nothing_to_compare() -> None:
    summary = summarize([_run("torchrun"), _run("torchft")],
                        {"torchrun": "torchrun", "torchft": "torchft"}, {"mlp": "ref"})
    assert ratios_of(summary) == {} and targets_of(summary) == []


def test_a_missing_torchft_is_a_failed_run_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    real = vs_torchft.importlib.util.find_spec
    monkeypatch.setattr(vs_torchft.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    run = SimpleNamespace(name="mlp-torchft-w2-main0")
    result = vs_torchft.run_torchft(run, tmp_path, 10.0, {})
    assert result["ok"] is False and "make bench-deps" in result["error"]
    assert not (tmp_path / run.name).exists()


def test_a_missing_lighthouse_binary_names_the_install(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(torchft_run.TorchftMissing, match="make bench-deps"):
        torchft_run.lighthouse_binary()
    assert "make bench-deps" in (vs_torchft.torchft_missing() or "")


def test_the_command_line_picks_systems_and_defaults_to_long_runs() -> None:
    args = parse_args([])
    assert steps_of(args, "transformer") == steps_of(args, "mlp") == (200, 174)
    assert args.run_timeout == 600.0
    assert "torchft" in args.system_list and "phalanx" in args.system_list
    picked = parse_args(["--quick", "--systems", "torchft"])
    assert picked.system_list == ["torchrun", "torchft"] and picked.steps == 32
    with pytest.raises(SystemExit):
        parse_args(["--systems", "nope"])


def test_the_phalanx_snapshot_settings_are_read_from_the_run_not_assumed(
        tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("job:\n  name: x\nsnapshot:\n  every_steps: auto\n"
                                          "  overhead_budget: 0.03\n")
    assert snapshot_config(tmp_path) == {"every_steps": "auto", "overhead_budget": 0.03}
    assert snapshot_config(tmp_path / "gone") is None and snapshot_config(None) is None
