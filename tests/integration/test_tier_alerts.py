"""Tier alerts leave the keeper: an S3 bucket that disappears after the launch check makes
every upload fail mid-run; the job still finishes with the fault-free parameters, and the
keepers' ``tier_degraded`` events reach events.jsonl and ``phalanx status``."""
from __future__ import annotations

import io
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from rich.console import Console

from phalanx.configs.schema import S3TierConfig
from phalanx.launcher.events import EventLog
from phalanx.launcher.rundir import RunDir
from phalanx.launcher.status import show_status
from phalanx.runtime.membership.etcd import EtcdMembership, job_prefix
from tests.integration.launching import HASH_RE, ROOT, latest_run, phalanx_command
from tests.integration.test_launch import reference_hash
from tests.plugins.leaks import Footprint, assert_nothing_left
from tests.plugins.s3 import make_client

pytestmark = pytest.mark.integration

STEPS = 20


def _wait_for_run_dir(root: Path, proc: subprocess.Popen, within_s: float) -> Path:
    """The run directory, which the launcher creates right after its tier checks passed."""
    latest = root / "latest"
    deadline = time.monotonic() + within_s
    while not latest.is_file():
        assert proc.poll() is None, "the launcher exited before creating its run directory"
        assert time.monotonic() < deadline, "no run directory"
        time.sleep(0.05)
    return Path(latest.read_text().strip())


@pytest.mark.timeout(120)
def test_bucket_lost_mid_run_is_reported_and_the_job_finishes(
        s3_config: S3TierConfig, tmp_path: Path, footprint: Footprint) -> None:
    cmd = phalanx_command(
        "configs/demo.yaml", "job.world_size=2", "spares.count=0", f"job.args.steps={STEPS}",
        "job.args.sleep_per_step_s=0.1", "tiers.s3.enabled=true",
        f"tiers.s3.bucket={s3_config.bucket}", f"tiers.s3.endpoint_url={s3_config.endpoint_url}",
        f"tiers.s3.region={s3_config.region}", "tiers.s3.every_steps=2", "tiers.s3.keep=1",
        run_root=tmp_path)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        _wait_for_run_dir(tmp_path, proc, within_s=60)
        # the launch check passed (and removed its probe: the bucket is empty); no worker
        # has started yet, so every upload of this run meets a missing bucket
        make_client(s3_config.endpoint_url).delete_bucket(Bucket=s3_config.bucket)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    # the run's directory as it ended: a start-up in which Ray lost a node (a loaded CI
    # machine) is tried again in a fresh one, after the test first read ``latest``
    run_dir = latest_run(tmp_path)
    hashes = {int(rank): digest for rank, digest in HASH_RE.findall(stdout)}
    torch.set_num_threads(1)
    assert hashes == dict.fromkeys((0, 1), reference_hash(world=2, steps=STEPS))

    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    degraded = [e for e in events if e["event"] == "tier_degraded"]
    assert degraded, [e["event"] for e in events]
    assert all(e["tier"] == "s3" and e["node"] in ("node0", "node1") for e in degraded)
    assert any(s3_config.bucket in e["error"] for e in degraded)
    assert events[0]["event"] == "started" and events[-1]["event"] == "finished"
    assert "tier_degraded" in stderr and "s3" in stderr  # one console warning per node
    assert_nothing_left(footprint)


@pytest.mark.timeout(30)
def test_status_shows_recent_events(etcd_endpoint: str, tmp_path: Path) -> None:
    prefix, job = f"/phalanx-test-{uuid.uuid4().hex[:8]}", "alerts"
    run = RunDir(tmp_path)
    run.write_job({"job": job, "etcd_endpoints": [etcd_endpoint], "etcd_prefix": prefix,
                   "world_size": 2})
    membership = EtcdMembership([etcd_endpoint], job_prefix(prefix, job), timeout_s=5.0).connect()
    try:
        events = EventLog(tmp_path / "events.jsonl", membership)
        events.emit("started", world_size=2)
        events.record("tier_persisted", tier="disk", node="node0", step=2)
        events.emit("tier_degraded", tier="s3", node="node1", step=4,
                    error="TierUnavailable: bucket 'gone' does not exist")
        events.close()
        out = io.StringIO()
        assert show_status(run, Console(file=out, width=200)) == 0
    finally:
        membership.close()
    text = out.getvalue()
    assert "recent events" in text and "tier_degraded" in text and "bucket 'gone'" in text
    assert "tier_persisted" not in text  # routine per-node events stay in events.jsonl
    assert [e["event"] for e in map(json.loads, (tmp_path / "events.jsonl").open())] == [
        "started", "tier_persisted", "tier_degraded"]
