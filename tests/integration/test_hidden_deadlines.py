"""No hidden deadlines, end to end (real etcd, Ray, gloo): rank 0 runs an evaluation pass
with no collectives, longer than ``recovery.group_timeout_s``, when rank 1 is killed. The
new generation cannot re-form without rank 0, so the job fails with ``GroupNotReformed``
naming rank 0 and what it was doing, within ``group_timeout_s`` + margin of the plan —
before this bound existed, the spare and rank 0 each waited out their group timeout and
then the workers' 120 s plan timeout, minutes with nothing in events.jsonl. And a rank
killed after the other rank returned from its entrypoint fails the job at once with
``FaultAfterFinish`` (before, a spare was promoted into a group nobody else would join)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from phalanx.launcher.coordination.bounds import REJOIN_MARGIN_S
from phalanx.runtime.worker.restore_progress import SLOW_RESTORE_ENV, restore_bound_s
from tests.integration.launching import (LaunchResult, ROOT, gloo_reference, latest_run, launch,
                                         phalanx_command)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]
GROUP_TIMEOUT_S = 6.0
HEARTBEAT_S = 0.1
SCENARIO = """name: kill_during_eval
description: kill rank 1 at step 4 while rank 0 evaluates outside session.step()
faults:
  - kind: kill_worker
    target: {rank: 1}
    trigger: {at_step: 4}
expect:
  outcome: fails
"""


def test_a_survivor_outside_collectives_past_the_group_timeout_fails_within_the_bound(
        tmp_path: Path) -> None:
    scenario = tmp_path / "kill_during_eval.yaml"
    scenario.write_text(SCENARIO)
    result = launch("configs/demo.yaml", "job.world_size=2", "spares.count=1",
                    f"etcd.heartbeat_s={HEARTBEAT_S}", "detection.poll_interval_s=0.05",
                    f"recovery.group_timeout_s={GROUP_TIMEOUT_S}",
                    "job.entrypoint=tests/integration/jobs/eval_at_fault.py:main",
                    "job.args={\"steps\": 8, \"eval_at\": 3, \"eval_s\": 60}",
                    f"drills.scenario={scenario}", run_root=tmp_path / "runs", timeout_s=140)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "GroupNotReformed" in result.stdout + result.stderr, result.stderr[-3000:]
    run = latest_run(tmp_path / "runs")
    events = [json.loads(line) for line in (run / "events.jsonl").open()]
    plan = next(e for e in events if e["event"] == "plan")
    stalled = [e for e in events if e["event"] == "recovery_stalled"]
    failed = [e for e in events if e["event"] == "job_failed"]
    assert len(stalled) == 1 and failed and failed[0]["error_type"] == "GroupNotReformed"
    assert "outside session.step()" in stalled[0]["ranks"]["0"], stalled[0]
    bound = GROUP_TIMEOUT_S + REJOIN_MARGIN_S + 2 * HEARTBEAT_S
    assert stalled[0]["bound_s"] == pytest.approx(bound)
    took = stalled[0]["time"] - plan["time"]
    assert bound - 1 <= took <= bound + 3, f"failed {took:.1f} s after the plan"


def test_a_fault_after_a_rank_finished_fails_at_once_naming_it(tmp_path: Path) -> None:
    result = launch("configs/demo.yaml", "job.world_size=2", "spares.count=1",
                    f"etcd.heartbeat_s={HEARTBEAT_S}", "detection.poll_interval_s=0.05",
                    "job.entrypoint=tests/integration/jobs/finish_then_die.py:main",
                    "job.args={\"steps\": 4, \"die_rank\": 1, \"linger_s\": 3}",
                    run_root=tmp_path, timeout_s=140)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "FaultAfterFinish" in result.stdout + result.stderr, result.stderr[-3000:]
    run = latest_run(tmp_path)
    events = [json.loads(line) for line in (run / "events.jsonl").open()]
    failed = [e for e in events if e["event"] == "job_failed"]
    assert failed and failed[0]["error_type"] == "FaultAfterFinish", failed
    assert "rank(s) 0 (step 4) had returned" in failed[0]["message"]
    assert not [e for e in events if e["event"] in ("plan", "promoted")]
    died = re.search(r"rank 1 dies at ([0-9.]+)",
                     "".join(p.read_text() for p in (run / "logs").glob("rank_1_*")))
    assert died is not None
    assert failed[0]["time"] - float(died.group(1)) < 5.0


SLOW_RESTORE_S = 12.0     # past the rejoin bound (group timeout 4 s + 5 s margin)


def test_a_spare_restoring_longer_than_the_group_timeout_is_waited_for(
        tmp_path: Path) -> None:
    """A promoted spare whose restore takes 12 s (a drill's slow restore) with
    ``recovery.group_timeout_s`` 4: it reports its restore while it runs, the survivor
    waits for it and the coordinator extends the rejoin bound (event ``restore_slow``,
    bounded by ``restore_bound_s``); the job recovers bit-identical. Before, the survivor's
    group timed out and the job failed with ``GroupNotReformed`` 9 s after the plan."""
    scenario = tmp_path / "kill.yaml"
    scenario.write_text(SCENARIO.replace("fails", "completes"))
    # the plan waits for the spare if it is still warming when the fault fires at step 4
    # (else it restarts the worker in its place: a race this test is not about)
    job = ("job.world_size=2", "spares.count=1", "spares.on_exhausted=wait",
           f"etcd.heartbeat_s={HEARTBEAT_S}",
           "detection.poll_interval_s=0.05", "recovery.group_timeout_s=4", "job.args.steps=12",
           "job.args.sleep_per_step_s=0.05",
           # the restore before the group forms, which the rejoin bound is about: a heal
           # forms the group first and its ranks wait in ``wait_restored`` instead
           "recovery.heal_from_peers=false")
    reference = gloo_reference("configs/demo.yaml", *job, run_root=tmp_path / "ref")
    proc = subprocess.run(phalanx_command("configs/demo.yaml", *job,
                                          f"drills.scenario={scenario}",
                                          run_root=tmp_path / "runs"),
                          cwd=ROOT, capture_output=True, text=True, timeout=140,
                          env={**os.environ, "COLUMNS": "200",
                               SLOW_RESTORE_ENV: str(SLOW_RESTORE_S)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = latest_run(tmp_path / "runs")
    events = [json.loads(line) for line in (run / "events.jsonl").open()]
    [slow] = [e for e in events if e["event"] == "restore_slow"]
    [recovered] = [e for e in events if e["event"] == "recovered"]
    assert list(slow["ranks"]) == ["1"] and slow["bound_s"] == restore_bound_s(4.0)
    assert recovered["fault_to_first_step_s"] >= SLOW_RESTORE_S, recovered
    assert LaunchResult(0, proc.stdout, proc.stderr).hashes == reference.hashes
