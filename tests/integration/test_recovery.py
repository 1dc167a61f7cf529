"""Checkpointless recovery policies end to end: real etcd, real Ray with virtual nodes,
gloo, the example job, world 4 on 2 virtual nodes, faults injected as real signals: spares
on dedicated nodes, no spare (a fresh worker, or a clean failure). The recoveries of every
shipped drill scenario (worker, hang, node, partition, tier fallback, exhausted spares...)
are tested by tests/integration/test_drills.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launching import ROOT, LaunchResult, Reference, gloo_reference, launch
from tests.plugins.leaks import Footprint, assert_nothing_left

pytestmark = pytest.mark.integration
JOB = ("job.args.steps=40", "job.args.sleep_per_step_s=0.03")
PID_RE = re.compile(r"event=worker_run rank=(\d+) pid=(\d+)")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return gloo_reference("configs/demo.yaml", *JOB, run_root=tmp_path_factory.mktemp("free"))


def run_dir_of(result: LaunchResult) -> Path:
    return Path(result.stdout.strip().splitlines()[-1].split(": ", 1)[1])


def events_of(result: LaunchResult) -> list[dict]:
    return [json.loads(line) for line in (run_dir_of(result) / "events.jsonl").open()]


def worker_pids(run_dir: Path) -> dict[str, int]:
    """worker log name → the pid that ran it (one pid per worker log: never restarted)."""
    pids = {}
    for log in (run_dir / "logs").iterdir():
        found = {int(pid) for _, pid in PID_RE.findall(log.read_text())}
        assert len(found) == 1, f"{log.name} was run by several processes: {found}"
        pids[log.stem] = found.pop()
    return pids


def assert_recovered(result: LaunchResult, fault_free: Reference, replaced_rank: int) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.hashes == fault_free.hashes, "final parameters differ from the fault-free run"
    events = events_of(result)
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1, [e["event"] for e in events]
    record = recovered[0]
    assert record["lost_steps"] <= 1
    assert record["ranks"] == [replaced_rank]
    logs = worker_pids(run_dir_of(result))
    survivors = {name for name in logs if not name.startswith(f"rank_{replaced_rank}_")}
    assert survivors == {f"rank_{r}_w{r}-g0" for r in range(4) if r != replaced_rank}
    assert any(name.startswith(f"rank_{replaced_rank}_spare") for name in logs)
    return record


@pytest.mark.timeout(400)
def test_spares_on_dedicated_nodes_without_replenishing(tmp_path: Path,
                                                        fault_free: Reference) -> None:
    """spares.placement: nodes keeps the spare on node 0, so rank 1 (node 1) moves there;
    spares.replenish: false starts no replacement after the promotion."""
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "-v", "launch", str(ROOT / "configs/demo.yaml")]
    for item in (*JOB, f"job.run_dir={tmp_path}", "spares.count=1", "spares.placement=nodes",
                 "spares.nodes=[0]", "spares.replenish=false",
                 "drills.scenario=configs/drills/kill_worker.yaml"):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    result = LaunchResult(proc.returncode, proc.stdout, proc.stderr)
    record = assert_recovered(result, fault_free, replaced_rank=1)
    promoted = [e for e in events_of(result) if e["event"] == "promoted"]
    assert [(e["rank"], e["node"]) for e in promoted] == [(1, "node0")]
    assert record["lost_steps"] <= 1
    # in the attempt that ran (a start-up lost on a starved machine starts everything
    # again in a fresh run directory: launcher.job.STARTUP_ATTEMPTS)
    last_attempt = result.stderr.rsplit("phalanx: run directory", 1)[-1]
    started = re.findall(r"event=spare_started spare=(\S+) node=(\d+)", last_attempt)
    assert started == [("spare0", "0")], started


@pytest.mark.timeout(400)
def test_no_spare_restarts_a_fresh_worker(tmp_path: Path, fault_free: Reference) -> None:
    result = launch("configs/demo.yaml", *JOB, "spares.count=0", "spares.on_exhausted=restart",
                    "drills.scenario=configs/drills/kill_worker.yaml", run_root=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.hashes == fault_free.hashes
    promoted = [e for e in events_of(result) if e["event"] == "promoted"]
    assert [(e["rank"], e["worker"]) for e in promoted] == [(1, "w1-g1")]


@pytest.mark.timeout(400)
def test_no_spare_with_fail_policy_stops_cleanly_naming_the_fault(
        tmp_path: Path, footprint: Footprint) -> None:
    result = launch("configs/demo.yaml", *JOB, "spares.count=0", "spares.on_exhausted=fail",
                    "drills.scenario=configs/drills/kill_worker.yaml", run_root=tmp_path)
    assert result.returncode == 1
    assert "PlanInfeasible" in result.stderr and "rank(s) [1]" in result.stderr
    assert "spare" in result.stderr
    assert_nothing_left(footprint)
