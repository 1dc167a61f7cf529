"""Only state that is replicated by construction is compared across ranks: a fault-free
data-parallel job with BatchNorm (per-rank running statistics) finishes with no
recovery, and ranks that never started from the same state fail naming that cause, not
silent corruption (the ranks themselves raise it, so a job faster than the launcher's
polls cannot finish unnoticed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.launching import latest_run, launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = ("job.entrypoint=tests/integration/jobs/train_batchnorm.py:main", "job.world_size=2",
       "spares.count=0", "job.args={\"steps\": 30}")


def _events(run_root: Path) -> list[dict]:
    run = latest_run(run_root)
    return [json.loads(line) for line in (run / "events.jsonl").open()]


def test_a_batchnorm_model_trains_fault_free_with_no_recovery(tmp_path: Path) -> None:
    result = launch("configs/demo.yaml", *JOB, run_root=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(set(result.hashes.values())) == 1 and len(result.hashes) == 2
    events = _events(tmp_path)
    assert not [e for e in events if e["event"] in ("fault", "sdc_detected", "recovered")]


def test_ranks_that_never_agreed_fail_naming_the_cause(tmp_path: Path) -> None:
    """The ranks raise it themselves where the comparison has its outcome: this 30-step
    job once finished with exit 0 on a loaded CI machine, before its launcher, which
    polls the member records, had seen any rank's record (its progress line still said
    step -1)."""
    result = launch("configs/demo.yaml", *JOB[:-1], "job.args={\"steps\": 30, \"seeded\": false}",
                    run_root=tmp_path)
    assert result.returncode == 1
    assert "ReplicasNeverAgreed" in result.stderr, result.stderr[-3000:]
    assert "did not start from the same state" in result.stderr
    assert not [e for e in _events(tmp_path) if e["event"] in ("sdc_detected", "recovered")]
