"""Silent data corruption end to end: the demo job (world 4 on 2 virtual nodes), one bit of
rank 2's parameters flipped in its worker's memory from this test process (the
``corrupt_params`` mechanism, through /proc/<pid>/mem), found by comparing replica digests
across ranks, repaired by rolling every rank back to the newest agreeing step with rank 2's
replicated state from a healthy peer. The run must end bit-identical to the fault-free
run, without restarting any worker."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from launcher.fault_memory import corrupt_params
from launcher.faults import FaultSpec
from runtime.base import MemberRecord
from runtime.membership_etcd import EtcdMembership, job_prefix
from runtime.memory_map import read_memory_maps
from tests.integration.launching import HASH_RE, ROOT, LaunchResult, launch, phalanx_command

pytestmark = pytest.mark.integration
JOB = ("job.args.steps=60", "job.args.sleep_per_step_s=0.05")
RANK, AT_STEP, BIT = 2, 20, 22      # bit 22: the top mantissa bit of element 0 (x1.5 or so)
PID_RE = re.compile(r"event=worker_run rank=(\d+) pid=(\d+)")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    result = launch("configs/demo.yaml", *JOB, run_root=tmp_path_factory.mktemp("free"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def wait_for(what: str, probe: Any, timeout_s: float, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def run_dir_under(root: Path) -> Path | None:
    latest = root / "latest"
    if not latest.is_file():
        return None
    path = Path(latest.read_text().strip())
    return path if (path / "job.json").is_file() else None


def members_of(run_dir: Path) -> EtcdMembership:
    job = json.loads((run_dir / "job.json").read_text())
    return EtcdMembership(job["etcd_endpoints"], job_prefix(job["etcd_prefix"], job["job"])
                          ).connect(retry_for_s=30)


def rank_record(membership: EtcdMembership, rank: int) -> MemberRecord | None:
    records = [m for m in membership.members().values() if m.rank == rank]
    return max(records, key=lambda m: m.generation, default=None)


def corrupt_when_running(run_root: Path) -> tuple[Path, dict[str, Any], int]:
    """Wait for rank ``RANK`` to pass step ``AT_STEP``, then flip its bit; returns (run
    directory, what the mechanism did, the step the rank had reported)."""
    run_dir = wait_for("the run directory", lambda: run_dir_under(run_root), 120)
    membership = members_of(run_dir)
    try:
        record = wait_for(f"rank {RANK} at step {AT_STEP}", lambda: (
            (r := rank_record(membership, RANK)) is not None and r.step >= AT_STEP
            and read_memory_maps(run_dir, RANK) and r), 180)
    finally:
        membership.close()
    env = SimpleNamespace(run_dir=run_dir, rank_pid=lambda rank: record.pid)
    done = dict(corrupt_params(FaultSpec("corrupt_params", rank=RANK, params={"bit": BIT}),
                               env))
    return run_dir, done, record.step


def events_in(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").open()]


@pytest.mark.timeout(500)
def test_flipped_bit_is_detected_and_repaired_bit_identically(
        tmp_path: Path, fault_free: LaunchResult) -> None:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(phalanx_command("configs/demo.yaml", *JOB,
                                                run_root=tmp_path / "runs"),
                                cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
        try:
            run_dir, done, step = corrupt_when_running(tmp_path / "runs")
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(f"flipped {done} at rank {RANK}'s step {step}")
    assert code == 0, err.read_text()[-3000:]
    assert done["tensor"] == "model/0.weight" and done["bit"] == BIT
    hashes = {int(r): d for r, d in HASH_RE.findall(out.read_text())}
    events = events_in(run_dir)
    detected = [e for e in events if e["event"] == "sdc_detected"]
    assert len(detected) == 1, [e["event"] for e in events]
    assert detected[0]["ranks"] == [RANK] and detected[0]["step"] >= step - 10
    assert detected[0]["verified_step"] < detected[0]["step"]
    assert len(set(detected[0]["digests"].values())) == 2
    recovered = [e for e in events if e["event"] == "recovered"]
    assert [r["fault"] for r in recovered] == ["silent_corruption"]
    assert recovered[0]["restore_step"] == detected[0]["verified_step"]
    plans = [e for e in events if e["event"] == "plan"]
    assert f"rank {RANK} <- rank" in plans[0]["reason"]
    assert hashes == fault_free.hashes, "final parameters differ from the fault-free run"
    pids: dict[str, set[int]] = {}
    for log in (run_dir / "logs").iterdir():
        pids[log.stem] = {int(pid) for _, pid in PID_RE.findall(log.read_text())}
    assert sorted(pids) == [f"rank_{r}_w{r}-g0" for r in range(4)]     # nobody replaced
    assert all(len(found) == 1 for found in pids.values())
    assert "event=replicas_repaired" in (run_dir / "logs" / f"rank_{RANK}_w{RANK}-g0.log"
                                         ).read_text()
