"""Checkpointless recovery end to end: real etcd, real Ray with virtual nodes, gloo, the
example job, world 4 on 2 virtual nodes with one warm spare, faults injected as real
signals. Each run must end bit-identical to the fault-free run, without restarting any
healthy worker, losing at most one step."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launching import ROOT, LaunchResult, launch
from tests.plugins.leaks import Footprint, assert_nothing_left

pytestmark = pytest.mark.integration
JOB = ("job.args.steps=40", "job.args.sleep_per_step_s=0.03")
PID_RE = re.compile(r"event=worker_run rank=(\d+) pid=(\d+)")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    result = launch("configs/demo.yaml", *JOB, run_root=tmp_path_factory.mktemp("free"))
    assert result.returncode == 0, result.stderr
    return result


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


def assert_recovered(result: LaunchResult, fault_free: LaunchResult, replaced_rank: int) -> dict:
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
def test_killed_worker_is_replaced_by_a_spare_bit_identically(
        tmp_path: Path, fault_free: LaunchResult, footprint: Footprint) -> None:
    result = launch("configs/demo.yaml", *JOB, "drills.scenario=configs/drills/kill_worker.yaml",
                    run_root=tmp_path)
    record = assert_recovered(result, fault_free, replaced_rank=1)
    assert record["fault"] == "worker_died"
    fired = [e for e in events_of(result) if e["event"] == "drill_fault"]
    assert fired and fired[0]["kind"] == "kill_worker"
    print(f"kill -> first step {record['first_step_at'] - fired[0]['time']:.3f} s, "
          f"phases {record['phases_s']}")
    assert_nothing_left(footprint)


@pytest.mark.timeout(400)
def test_spares_on_dedicated_nodes_without_replenishing(tmp_path: Path,
                                                        fault_free: LaunchResult) -> None:
    """spares.placement: nodes keeps the spare on node 0, so rank 1 (node 1) moves there;
    spares.replenish: false starts no replacement after the promotion."""
    cmd = [sys.executable, "-m", "launcher.cli", "-v", "launch", str(ROOT / "configs/demo.yaml")]
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
    started = re.findall(r"event=spare_started spare=(\S+) node=(\d+)", result.stderr)
    assert started == [("spare0", "0")], started


@pytest.mark.timeout(400)
def test_hung_worker_is_detected_killed_and_replaced(tmp_path: Path,
                                                     fault_free: LaunchResult) -> None:
    result = launch("configs/demo.yaml", *JOB, "drills.scenario=configs/drills/hang_worker.yaml",
                    run_root=tmp_path)
    record = assert_recovered(result, fault_free, replaced_rank=2)
    assert record["fault"] in ("lease_lost", "stalled")
    fired = [e for e in events_of(result) if e["event"] == "drill_fault"][0]
    print(f"SIGSTOP -> first step {record['first_step_at'] - fired['time']:.3f} s")


@pytest.mark.timeout(400)
def test_no_spare_restarts_a_fresh_worker(tmp_path: Path, fault_free: LaunchResult) -> None:
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


@pytest.mark.timeout(400)
def test_killed_node_is_restored_from_replicas(tmp_path: Path, fault_free: LaunchResult,
                                              footprint: Footprint) -> None:
    result = launch("configs/demo.yaml", *JOB, "spares.count=2",
                    "drills.scenario=configs/drills/kill_node.yaml", run_root=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.hashes == fault_free.hashes
    events = events_of(result)
    record = [e for e in events if e["event"] == "recovered"][0]
    assert record["lost_steps"] <= 1
    plan = [e for e in events if e["event"] == "plan"][0]
    assert "Rollback" not in plan["actions"], "replicas must have been enough"
    logs = worker_pids(run_dir_of(result))
    assert {"rank_0_w0-g0", "rank_2_w2-g0"} <= set(logs)  # node 0's workers kept running
    # noticed by the keeper watch (keeper and raylet ports refuse), not Ray's health checks
    assert "event=node_gone node=node1" in result.stderr, result.stderr[-3000:]
    assert_nothing_left(footprint)   # the dead node's shared memory too


@pytest.mark.timeout(400)
def test_two_lost_nodes_roll_back_to_the_disk_checkpoint(tmp_path: Path,
                                                          fault_free: LaunchResult) -> None:
    result = launch("configs/demo.yaml", *JOB, "job.nodes=3", "ray.virtual_nodes=3",
                    "spares.count=3", "drills.scenario=configs/drills/tier_fallback.yaml",
                    run_root=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.hashes == fault_free.hashes
    plan = [e for e in events_of(result) if e["event"] == "plan"][0]
    # a lost rank's only replica died too: every rank resumes from the disk checkpoint
    # (tiers.disk.every_steps=20), either as an explicit Rollback or because the committed
    # step is the checkpoint itself
    assert plan["restore_step"] == 20, plan
    assert "RestoreFromTier" in plan["actions"], plan


@pytest.mark.timeout(400)
def test_exhausted_spares_with_wait_policy_park_until_a_new_spare_is_warm(
        tmp_path: Path, fault_free: LaunchResult) -> None:
    """Two ranks die at once with one spare: the recovery is parked (phase degraded), the
    pool starts a second spare, and both ranks are promoted from warm spares."""
    result = launch("configs/demo.yaml", *JOB, "spares.count=1", "spares.on_exhausted=wait",
                    "drills.scenario=configs/drills/spare_exhausted.yaml", run_root=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.hashes == fault_free.hashes
    events = events_of(result)
    waiting = [e for e in events if e["event"] == "waiting_for_capacity"]
    assert len(waiting) == 1 and waiting[0]["spares_needed"] == 2, waiting
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and set(recovered[0]["ranks"]) <= {1, 2}, recovered
    assert recovered[0]["lost_steps"] <= 1
    promoted = [e for e in events if e["event"] == "promoted"]
    assert sorted(e["rank"] for e in promoted) == [1, 2]
    assert all(e["worker"].startswith("spare") for e in promoted)   # never a cold restart
    assert len({e["worker"] for e in promoted}) == 2
    degraded = [e for e in events if e["event"] == "phase" and e["to"] == "degraded"]
    assert degraded, "the parked recovery must show as phase degraded"
    assert len([e for e in events if e["event"] == "fault"]) == 2   # not re-emitted
