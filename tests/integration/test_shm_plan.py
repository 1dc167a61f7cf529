"""A job whose real snapshots do not fit shared memory (``snapshot.rank_size_mb: 0``, an
8 MiB tmpfs as ``snapshot.shm_dir``, like Docker's small /dev/shm) never trains without a
safety net unknowingly: it fails at the first snapshot with ``MemoryPlanExceeded`` naming
the sizes and the fix, and no recovery is tried; with ``snapshot.allow_unprotected`` it
trains to the end, a ``snapshot_unprotected`` alert lands in events.jsonl and
``phalanx status`` shows the degraded protection."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.launching import ROOT, latest_run, launch
from tests.plugins.small_tmpfs import small_tmpfs

pytestmark = pytest.mark.integration

# 2 ranks on 2 nodes, hidden 320: ~0.9 MB of snapshot per rank. Each keeper's 3 slots fit
# 8 MiB (5.2 MB for both nodes); the plan with 3 replica buffers per node does not (10.4 MB).
JOB = ("job.world_size=2", "job.nodes=2", "ray.virtual_nodes=2", "job.args.steps=6",
       "job.args.hidden=320", "job.args.sleep_per_step_s=0", "snapshot.rank_size_mb=0",
       "tiers.disk.enabled=false")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[str]:
    with small_tmpfs(tmp_path / "shm", 8) as folder:
        yield folder


def _events(run_root: Path) -> list[dict]:
    lines = (latest_run(run_root) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.timeout(150)
def test_snapshots_beyond_shared_memory_fail_the_job_at_the_first_snapshot(
        tmp_path: Path, tmpfs: str) -> None:
    started = time.monotonic()
    result = launch("configs/demo.yaml", *JOB, f"snapshot.shm_dir={tmpfs}", "spares.count=1",
                    run_root=tmp_path / "runs", timeout_s=120)
    took = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "MemoryPlanExceeded" in out and "first snapshot measured" in out, out[-3000:]
    assert "bytes free" in out and tmpfs in out
    assert "snapshot.allow_unprotected: true" in out and "--shm-size" in out
    assert "final parameter hash" not in result.stdout
    kinds = [e["event"] for e in _events(tmp_path / "runs")]
    assert "recovery_started" not in kinds and "fault" not in kinds, kinds
    assert os.listdir(tmpfs) == [], "the job's shared memory is released"
    print(f"failed after {took:.1f} s")


@pytest.mark.timeout(150)
def test_allow_unprotected_trains_on_with_an_alert_and_a_status_line(
        tmp_path: Path, tmpfs: str) -> None:
    runs = tmp_path / "runs"
    result = launch("configs/demo.yaml", *JOB, f"snapshot.shm_dir={tmpfs}", "spares.count=0",
                    "snapshot.allow_unprotected=true", run_root=runs, timeout_s=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert len(result.hashes) == 2
    alerts = [e for e in _events(runs) if e["event"] == "snapshot_unprotected"]
    assert alerts and {e["node"] for e in alerts} <= {"node0", "node1"}, alerts
    assert "first snapshot measured" in alerts[0]["reason"] and alerts[0]["plan_bytes"] > 8 << 20
    assert "snapshot_unprotected" in result.stdout + result.stderr    # the console's warning
    status = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "status",
                             str(latest_run(runs))], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "COLUMNS": "300"})
    assert "snapshot protection: DEGRADED" in status.stdout + status.stderr, status.stderr
