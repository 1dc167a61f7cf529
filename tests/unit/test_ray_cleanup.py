"""``LocalRay.close`` after a start that failed inside Ray's ``Cluster()``: no Cluster
object owns the head's GCS and raylet then, and they lived on until the launcher exited.
Every process that names the cluster's private temp dir, or holds a file open in it, goes;
a process naming another folder stays."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.configs.schema import RayConfig
from phalanx.launcher.services.ray_cluster import LocalRay, processes_naming

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SLEEP = "import time; time.sleep(120)"


def test_close_kills_what_a_failed_start_left_and_nothing_else(tmp_path: Path) -> None:
    temp = tmp_path / "phx-ray-abc"
    temp.mkdir()
    # what a GCS's command line looks like: its log dir inside the cluster's temp dir
    orphan = subprocess.Popen([sys.executable, "-c", SLEEP, f"--log_dir={temp}/session_1/logs"])
    # what an agent looks like once it has retitled itself: only its open log names the dir
    (temp / "agent.log").touch()
    with (temp / "agent.log").open() as log:
        agent = subprocess.Popen([sys.executable, "-c", SLEEP], stdout=log)
    bystander = subprocess.Popen([sys.executable, "-c", SLEEP, f"--log_dir={tmp_path}/other"])
    try:
        assert sorted(processes_naming(str(temp))) == sorted([orphan.pid, agent.pid])
        cluster = LocalRay(RayConfig())
        cluster._temp_dir = temp        # what _start_once had made when Cluster() raised
        cluster.close()
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert agent.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
        assert not temp.exists()
        cluster.close()                 # idempotent
    finally:
        for proc in (orphan, agent, bystander):
            proc.kill()
            proc.wait()
