"""A standby launcher takes over a running job when its leader is SIGKILLed: real etcd, a
real Ray cluster that outlives both launchers, gloo, the example job at world 4 on two
virtual nodes. The workers keep training through the takeover (same PIDs), the standby then
recovers a killed worker on its own TCPStore, and the run ends bit-identical to a fault-free
run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from phalanx.launcher.services.leadership import COORDINATOR_KEY
from phalanx.runtime.membership.etcd import EtcdMembership, job_prefix
from tests.integration.launching import (ROOT, LaunchResult, Reference, gloo_reference,
                                         latest_run, phalanx_command)
from tests.integration.test_recovery import worker_pids

pytestmark = pytest.mark.integration
# long enough that the workers are still training once the standby took over: the kill
# comes a few steps in, and a takeover (lease TTL, adopting keepers and spares) takes ~4 s
JOB = ("job.args.steps=200", "job.args.sleep_per_step_s=0.05")
NAME = "standbyjob"


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A Ray cluster of its own process, as an operator's would be."""
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.launcher.services.ray_cluster", "--nodes", "2",
                             "--cpus-per-node", "4"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        yield json.loads(line)["address"]
    finally:
        proc.terminate()
        proc.wait(timeout=120)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return gloo_reference("configs/demo.yaml", *JOB, run_root=tmp_path_factory.mktemp("free"))


class Launcher:
    """``phalanx launch`` as a background process whose stderr is collected as it comes."""

    def __init__(self, *overrides: str, run_root: Path, standby: bool = False) -> None:
        cmd = phalanx_command("configs/demo.yaml", *overrides, run_root=run_root)
        self.proc = subprocess.Popen(cmd + (["--standby"] if standby else []), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "COLUMNS": "200"})
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.err)

    def finish(self, timeout_s: float) -> LaunchResult:
        stdout, _ = self.proc.communicate(timeout=timeout_s)
        self._reader.join(timeout=5)
        return LaunchResult(self.proc.returncode, stdout, "".join(self.err))


def wait_until(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_standby_takes_over_a_killed_leader_and_recovers_the_next_fault(
        tmp_path: Path, etcd_endpoint: str, ray_address: str, fault_free: Reference) -> None:
    shared = (*JOB, f"job.name={NAME}", f"etcd.endpoints=[{etcd_endpoint}]",
              f"ray.address={ray_address}", "coordinator.standby=true")
    etcd = EtcdMembership([etcd_endpoint], job_prefix("/phalanx", NAME)).connect()

    def slowest_step() -> int:
        steps = [m.step for m in etcd.members().values() if m.rank >= 0]
        return min(steps) if len(steps) == 4 else -1

    leader = Launcher(*shared, run_root=tmp_path)
    try:
        # the standby starts while the leader sets up, so its own start-up (seconds on a
        # loaded machine) does not eat into the training left after the kill
        wait_until(lambda: etcd.get(COORDINATOR_KEY) is not None, 120, "the leader's lease")
        standby = Launcher(*shared, run_root=tmp_path, standby=True)
        wait_until(lambda: slowest_step() >= 5, 240, "the leader's workers to train")
        wait_until(lambda: standby.saw("standing by"), 120, "the standby to stand by")
        before = slowest_step()
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(timeout=30)
        wait_until(lambda: standby.saw("took over job"), 60, "the takeover")
        run_dir = latest_run(tmp_path)
        wait_until(lambda: slowest_step() >= before + 3, 60, "training past the takeover")
        # the standby must also recover: kill rank 1's worker, on the standby's TCPStore
        victim = worker_pids(run_dir)["rank_1_w1-g0"]
        os.kill(victim, signal.SIGKILL)
        result = standby.finish(timeout_s=400)
    finally:
        for launcher in [leader] + ([standby] if "standby" in locals() else []):
            if launcher.proc.poll() is None:
                launcher.proc.kill()
        etcd.close()

    assert result.returncode == 0, result.stderr[-4000:]
    assert result.hashes == fault_free.hashes, "final parameters differ from the fault-free run"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    kinds = [e["event"] for e in events]
    assert kinds.count("coordinator_takeover") == 1, kinds
    takeover = kinds.index("coordinator_takeover")
    recovered = [e for e in events[takeover:] if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["ranks"] == [1], kinds
    # healed from the survivors: only the step in flight is redone. A kill that lands
    # after rank 1's optimizer step and before its per-rank snapshot of that step reached
    # its keeper (a known window, issue 19) leaves no step to heal at: every rank then
    # restores the committed step (event heal_fallback) and the loss is bounded by it
    logs = "".join(p.read_text() for p in (run_dir / "logs").iterdir())
    if recovered[0]["healed"]:
        assert recovered[0]["lost_steps"] <= 1, recovered[0]
    else:
        assert "event=heal_fallback" in logs and recovered[0]["restore_step"] >= 0, recovered[0]
    pids = worker_pids(run_dir)
    # ranks 0, 2 and 3 ran in one process each from the leader's start to the end
    assert {f"rank_{r}_w{r}-g0" for r in (0, 2, 3)} <= set(pids)
    assert any(name.startswith("rank_1_spare") for name in pids)
    assert "store_moved" in "".join(
        (run_dir / "logs" / f"{name}.log").read_text() for name in pids
        if name.startswith("rank_0_"))
