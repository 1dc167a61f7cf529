"""Healthy long work is no hang: a job whose steps take 3 s with ``stall_timeout_s=0.5``
(the ratio of 30 s steps to the demo's 5 s timeout; a run with real 30 s steps is too slow
for the suite) and a job with an evaluation pass outside ``session.step()`` and a
``session.busy()`` block, both longer than ``stall_timeout_s``, finish with no fault and
no recovery (real etcd, Ray, gloo; real hangs stay covered by the ``hang_worker`` drill)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.launching import latest_run, launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SMALL = ("job.world_size=2", "spares.count=0", "etcd.heartbeat_s=0.1",
         "detection.poll_interval_s=0.05")


def _faults(run_root: Path) -> list[dict]:
    run = latest_run(run_root)
    events = [json.loads(line) for line in (run / "events.jsonl").open()]
    return [e for e in events if e["event"] in ("fault", "recovered")]


def test_steps_six_times_the_stall_timeout_finish_with_no_recovery(tmp_path: Path) -> None:
    result = launch("configs/demo.yaml", *SMALL, "detection.stall_timeout_s=0.5",
                    "job.args.steps=4", "job.args.sleep_per_step_s=3", run_root=tmp_path,
                    timeout_s=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(set(result.hashes.values())) == 1 and len(result.hashes) == 2
    assert _faults(tmp_path) == []


def test_evaluation_outside_a_step_and_busy_work_finish_with_no_recovery(
        tmp_path: Path) -> None:
    result = launch("configs/demo.yaml", *SMALL, "detection.stall_timeout_s=1",
                    "job.entrypoint=tests/integration/jobs/train_with_eval.py:main",
                    "job.args={\"steps\": 10, \"eval_s\": 3, \"busy_s\": 3}",
                    run_root=tmp_path, timeout_s=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _faults(tmp_path) == []
