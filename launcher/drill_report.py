"""``phalanx drill``: run a job fault-free, run it again with a drill scenario injected (each
run a separate ``phalanx launch`` process, as a user would run them), and check the drill's
expectations (recovery time, lost steps, bit-identical final state)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from launcher.drills import Scenario, load_scenario
from launcher.events import read_events

HASH_RE = re.compile(r"^rank (\d+) final parameter hash ([0-9a-f]{64})$", re.M)
RUN_RE = re.compile(r"^run directory: (.+)$", re.M)


@dataclass
class LaunchOutcome:
    returncode: int
    hashes: dict[int, str]
    run_dir: Path | None
    stderr_tail: str


def launch(config: str, overrides: Sequence[str]) -> LaunchOutcome:
    cmd = [sys.executable, "-m", "launcher.cli", "launch", config]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    run = RUN_RE.search(proc.stdout)
    return LaunchOutcome(proc.returncode, {int(r): h for r, h in HASH_RE.findall(proc.stdout)},
                         Path(run.group(1)) if run else None, "")


def check(scenario: Scenario, reference: LaunchOutcome,
          drilled: LaunchOutcome) -> list[dict[str, Any]]:
    """One row per expectation: what was expected, what was measured, and whether it held."""
    rows_run = [{"check": "drilled job finished", "expected": "exit 0",
                 "measured": f"exit {drilled.returncode}", "ok": drilled.returncode == 0}]
    if drilled.run_dir is None:
        return rows_run
    events = read_events(drilled.run_dir / "events.jsonl")
    fired = [e for e in events if e["event"] == "drill_fault"]
    recovered = [e for e in events if e["event"] == "recovered"]
    rows = rows_run + [{"check": "every fault fired", "expected": len(scenario.faults),
             "measured": len(fired), "ok": len(fired) == len(scenario.faults)},
            {"check": "recovered", "expected": ">= 1", "measured": len(recovered),
             "ok": bool(recovered)}]
    expect = scenario.expect
    if "max_recovery_s" in expect and fired and recovered:
        worst = max(r["first_step_at"] for r in recovered) - min(f["time"] for f in fired)
        rows.append({"check": "fault to first step (s)", "expected": f"<= {expect['max_recovery_s']}",
                     "measured": round(worst, 3), "ok": worst <= float(expect["max_recovery_s"])})
    if "max_lost_steps" in expect and recovered:
        lost = max(r["lost_steps"] for r in recovered)
        rows.append({"check": "lost steps", "expected": f"<= {expect['max_lost_steps']}",
                     "measured": lost, "ok": lost <= int(expect["max_lost_steps"])})
    if expect.get("final_state") == "identical":
        same = bool(drilled.hashes) and reference.hashes == drilled.hashes
        rows.append({"check": "final parameters", "expected": "bit-identical to fault-free",
                     "measured": "identical" if same else "DIFFERENT", "ok": same})
    return rows


def run_drill(config: str, overrides: Sequence[str], scenario_path: str,
              console: Console) -> int:
    """Exit 0 when every expectation held, 1 otherwise."""
    scenario = load_scenario(scenario_path)
    console.print(f"drill {scenario.name}: {scenario.description}")
    console.print("1/2 fault-free reference run")
    reference = launch(config, [*overrides, "drills.scenario=''"])
    if reference.returncode != 0:
        console.print(f"the fault-free run failed (exit {reference.returncode}); fix it first")
        return 1
    console.print(f"2/2 the same run with {len(scenario.faults)} fault(s) injected")
    drilled = launch(config, [*overrides, f"drills.scenario={scenario_path}"])
    rows = check(scenario, reference, drilled)
    table = Table(title=f"drill {scenario.name}")
    for column in ("check", "expected", "measured", "result"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["check"], str(row["expected"]), str(row["measured"]),
                      "PASS" if row["ok"] else "FAIL")
    console.print(table)
    passed = all(r["ok"] for r in rows)
    if drilled.run_dir is not None:
        recoveries = [e for e in read_events(drilled.run_dir / "events.jsonl")
                      if e["event"] == "recovered"]
        report = {"scenario": scenario.name, "reference_run": str(reference.run_dir),
                  "drill_run": str(drilled.run_dir), "checks": rows, "recoveries": recoveries,
                  "passed": passed}
        (drilled.run_dir / "drill_report.json").write_text(json.dumps(report, indent=2))
        console.print(f"report: {drilled.run_dir / 'drill_report.json'}")
    console.print("drill PASSED" if passed else "drill FAILED")
    return 0 if passed else 1
