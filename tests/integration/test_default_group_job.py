"""The default process group in a launched job, after a recovery: a worker killed mid-run
(drill kill_worker), then ``dist.all_reduce``, ``broadcast``, ``all_gather``,
``all_gather_object``, ``barrier``, ``DistributedSampler()`` with default arguments and
``torch.distributed.checkpoint`` (save, async_save, load with phalanx's storage: one
coordinator, every rank its own shard, in the job's ``<job>.dcp`` namespace) all run on the
same ``dist.group.WORLD`` the script got before the fault."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launching import ROOT

pytestmark = pytest.mark.integration
JOB = ROOT / "tests" / "integration" / "jobs" / "dist_api_job.py"


@pytest.mark.timeout(300)
def test_the_default_group_api_and_dcp_work_after_a_recovery(tmp_path: Path) -> None:
    out = tmp_path / "seen"
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.launcher.cli", "launch", str(ROOT / "configs/ddp.yaml"),
         "--set", f"job.run_dir={tmp_path / 'runs'}", "--set", f"job.entrypoint={JOB}",
         "--set", f'job.argv=["--steps", "30", "--out", "{out}"]', "--set", "job.name=api",
         "--set", "drills.enabled=true",
         "--set", f"drills.scenario={ROOT / 'configs/drills/kill_worker.yaml'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "recovered from worker_died" in proc.stdout, proc.stdout[-2000:]
    seen = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(4)]
    for rank, view in enumerate(seen):
        assert view["recoveries"] == (0 if rank == 1 else 1), view   # rank 1: the spare
        assert view["generation"] == 1 and view["same_world"] and view["backend"] == "gloo"
        assert (view["rank"], view["world"]) == (rank, 4)
        assert view["all_reduce"] == 10.0 and view["broadcast"] == 30.0
        assert view["all_gather"] == [0.0, 1.0, 2.0, 3.0]
        assert view["all_gather_object"] == [{"rank": r} for r in range(4)]
        assert view["sampler"] == [4, rank] and view["dcp_round_trip"]
    run_dir = next((tmp_path / "runs").glob("api-*"))
    dcp_steps = sorted(int(p.name.removeprefix("step_"))
                       for p in (run_dir / "checkpoints" / "api.dcp").iterdir()
                       if p.name.startswith("step_"))
    assert dcp_steps == [100, 101]
    job_steps = run_dir / "checkpoints" / "api"      # the job's own steps, apart
    assert not job_steps.exists() or not any(
        p.name.startswith("step_") and int(p.name.removeprefix("step_")) in dcp_steps
        for p in job_steps.iterdir())
