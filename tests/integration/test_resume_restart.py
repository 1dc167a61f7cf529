"""A resumed run's fault before its first commit (issue 17, items 1 and 6): a run started
with ``phalanx launch --resume STEP`` that loses a rank before anything of its own is
committed is restarted by the coordinator's "nothing committed" path, and every rank
starts over from the resume checkpoint (verified again as it restores), not from its
script's initial state: the run ends bit-identical to the uninterrupted run. Before, the
restart trained from scratch (with run 2's learning rate, not the checkpoint's) and ended
with other parameters."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.launching import ROOT, LaunchResult, latest_run, launch, phalanx_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CONFIG = "configs/demo.yaml"
STEPS = 20
SCENARIO = """name: kill_after_resume
description: kill rank 1 in a resumed run before the run's first commit
faults:
  - kind: kill_worker
    target: {{rank: 1}}
    trigger: {{at_step: {step}}}
expect:
  outcome: completes
"""


def _events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_resumed_run_restarted_before_its_first_commit_restores_the_resume_point(
        tmp_path: Path) -> None:
    tier, runs = tmp_path / "tier", tmp_path / "runs"
    job = ("job.world_size=2", "spares.count=0", f"job.args.steps={STEPS}",
           "job.args.sleep_per_step_s=0.05", "tiers.disk.every_steps=5", "tiers.disk.keep=10",
           "snapshot.every_steps=1",    # tiers persist full snapshots: one every step
           f"tiers.disk.path={tier}", "etcd.heartbeat_s=0.2", "detection.poll_interval_s=0.05")
    # run 1 trains with another learning rate than run 2's config: a resumed run restores
    # it with the optimizer's state, a run restarted from scratch would train with 0.05
    first = launch(CONFIG, *job, "job.args.lr=0.2", run_root=runs, timeout_s=120)
    assert first.returncode == 0, first.stderr[-3000:]
    committed = sorted(int(p.parent.name.split("_")[1]) for p in tier.glob("demo/step_*/COMMIT"))
    assert committed and committed[0] <= STEPS - 5, committed
    resume_at = committed[0]
    run1 = latest_run(runs)
    scenario = tmp_path / "kill_after_resume.yaml"
    scenario.write_text(SCENARIO.format(step=resume_at + 2))
    # no snapshots and no disk checkpoint before the end: nothing of run 2 is committed
    # when rank 1 dies, so the coordinator restarts every rank
    proc = subprocess.run([*phalanx_command(CONFIG, *job, "snapshot.enabled=false",
                                            "tiers.disk.every_steps=1000",
                                            f"drills.scenario={scenario}", run_root=runs),
                           "--resume", str(resume_at)],
                          cwd=ROOT, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    run2 = latest_run(runs)
    assert run2 != run1
    [resumed] = _events(run2, "resumed_from")
    assert resumed["step"] == resume_at and resumed["run_id"] == run1.name
    hashes = LaunchResult(proc.returncode, proc.stdout, proc.stderr).hashes
    # bit-identical to run 1 going on uninterrupted (= a fault-free resumed run: test_resume)
    assert len(hashes) == 2 and hashes == first.hashes, "restarted from scratch?"
    [plan] = _events(run2, "plan")
    assert plan["restore_step"] == -1 and "RestartWorker" in plan["actions"], plan
    [restart] = _events(run2, "restart_from_resume")
    assert restart["step"] == resume_at and restart["run_id"] == run1.name
    [recovered] = _events(run2, "recovered")
    assert recovered["restore_step"] == resume_at
