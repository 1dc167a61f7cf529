"""``phalanx status --json`` against a real job: while it trains (state running, every rank
listed, what the keepers hold, goodput so far) and after it finished (its summary.json:
outcome, steps, goodput summing to the wall time), both checked against one schema, and
never a connection error once the job's etcd is gone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launching import ROOT, phalanx_command, wait_training
from tests.plugins.leaks import Footprint, assert_nothing_left

pytestmark = pytest.mark.integration
ENV = {**os.environ, "COLUMNS": "160"}
JOB = ("job.world_size=2", "job.args.steps=60", "job.args.sleep_per_step_s=0.1",
       "spares.count=0")
NUMBER = (int, float)
OPTIONAL_DICT = (dict, type(None))
SCHEMA: dict[str, Any] = {
    "job": str, "run_dir": str, "state": str, "generation": int, "phase": str,
    "committed_step": int, "world_size": int, "ranks": [{
        "rank": int, "worker": str, "node": str, "step": int, "generation": int, "state": str,
        "heartbeat_age_s": NUMBER}],
    "keepers": [{"node": str, "bytes_held": int, "bytes_shared": int, "local": dict,
                 "replicas": dict}],
    "events": [{"event": str, "time": NUMBER}],
    "goodput": {"wall_s": NUMBER, "effective": NUMBER, "startup_s": NUMBER,
                "productive_s": NUMBER, "redone_s": NUMBER, "snapshot_stall_s": NUMBER,
                "recovery_s": dict, "waiting_for_capacity_s": NUMBER, "shutdown_s": NUMBER,
                "sum_s": NUMBER, "snapshot_stall_reported": bool, "redone_from": str},
    "summary": OPTIONAL_DICT,
}
SUMMARY_SCHEMA: dict[str, Any] = {
    "outcome": str, "job": str, "world_size": int, "steps": int, "generation": int,
    "committed_step": int, "recoveries": int, "recovery_history": list, "wall_s": NUMBER,
    "started_at": NUMBER, "ended_at": NUMBER, "goodput": dict}


def check(value: Any, schema: Any, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (a type or tuple of types; a dict of required
    keys; a one-item list: every element matches the item)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not an object"]
        return [problem for key, sub in schema.items()
                for problem in ([f"{where}.{key}: missing"] if key not in value
                                else check(value[key], sub, f"{where}.{key}"))]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not a list"]
        return [p for i, item in enumerate(value) for p in check(item, schema[0], f"{where}[{i}]")]
    if isinstance(value, bool) and schema is not bool and bool not in (
            schema if isinstance(schema, tuple) else (schema,)):
        return [f"{where}: a bool"]
    return [] if isinstance(value, schema) else [f"{where}: {type(value).__name__}"]


def status_json(run_dir: Path) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "status", str(run_dir),
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=ENV)
    assert "Connection refused" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc


def assert_sums_to_wall(goodput: dict[str, Any]) -> None:
    parts = [goodput[k] for k in ("startup_s", "productive_s", "redone_s", "snapshot_stall_s",
                                  "waiting_for_capacity_s", "shutdown_s")]
    total = sum(parts) + sum(goodput["recovery_s"].values())
    assert goodput["wall_s"] > 0 and abs(total - goodput["wall_s"]) <= 0.01 * goodput["wall_s"]
    assert goodput["effective"] == pytest.approx(goodput["productive_s"] / goodput["wall_s"],
                                                 abs=1e-3)


@pytest.mark.timeout(240)
def test_status_json_of_a_live_and_a_finished_job(tmp_path: Path, footprint: Footprint) -> None:
    proc = subprocess.Popen(phalanx_command("configs/demo.yaml", *JOB, run_root=tmp_path),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    try:
        run_dir = wait_training(tmp_path, past_step=5, proc=proc, timeout_s=90)
        live, _ = status_json(run_dir)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]

    assert check(live, SCHEMA) == [], json.dumps(live)[:3000]
    assert live["state"] == "running" and live["job"] == "demo" and live["summary"] is None
    assert sorted(r["rank"] for r in live["ranks"]) == [0, 1]
    assert all(r["step"] >= 5 and r["heartbeat_age_s"] < 10 for r in live["ranks"])
    assert sorted(k["node"] for k in live["keepers"]) == ["node0", "node1"]
    assert live["phase"] == "steady" and live["events"]
    # the demo's DDP model and optimizer are replicated over both ranks; the scheduler and
    # the RNGs are each rank's own, snapshotted every step
    copies = {row["class"]: row for row in live["state_copies"]}
    assert set(copies) == {"replicated", "per_rank"}, live["state_copies"]
    assert set(copies["replicated"]["objects"]) == {"model", "optimizer"}
    assert "scheduler" in copies["per_rank"]["objects"]
    assert copies["replicated"]["live"].startswith("2 (every rank")
    assert "1 replica on other nodes" in copies["replicated"]["snapshots"]
    assert copies["per_rank"]["snapshots"].startswith("every step")
    assert_sums_to_wall(live["goodput"])
    assert live["goodput"]["productive_s"] > 0

    goodput_line = next(line for line in out.splitlines() if line.startswith("goodput "))
    finished, _ = status_json(run_dir)
    assert check(finished, SCHEMA) == [], json.dumps(finished)[:3000]
    assert finished["state"] == "finished" and finished["ranks"] == []
    summary = finished["summary"]
    assert check(summary, SUMMARY_SCHEMA) == [], summary
    assert summary["outcome"] == "finished" and summary["steps"] == 60
    assert summary["recoveries"] == 0 and summary["world_size"] == 2
    assert summary == json.loads((run_dir / "summary.json").read_text())
    goodput = finished["goodput"]
    assert_sums_to_wall(goodput)
    assert goodput["wall_s"] == pytest.approx(summary["wall_s"], abs=0.01)
    # steps after the first one the launcher saw every rank past (a heartbeat may hold a few)
    assert goodput["snapshot_stall_reported"] and 50 <= goodput["steps_computed"] <= 59
    assert 0 < goodput["effective"] < 1 and goodput["startup_s"] > 0
    assert f"{goodput['effective'] * 100:.1f}%" in goodput_line

    view = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "status", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)
    assert view.returncode == 0 and "job demo finished: 60 steps" in view.stderr, view.stderr
    assert "goodput " in view.stderr and "Connection refused" not in view.stderr
    assert_nothing_left(footprint)
