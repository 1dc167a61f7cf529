"""The wait on a job's first work on the local Ray's nodes (``LocalRay.first_work``: the
keepers' start): a raylet that dies while its node's first worker starts fails the attempt
within seconds (the launcher then starts the job once more: ``StartupLost``), not after
the wait's whole timeout. Seen on a loaded 2-core machine: a raylet SIGKILLed at start-up
cost a minute of waiting for work that could never run."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray

from phalanx.configs.errors import ServiceStartError
from phalanx.configs.schema import RayConfig
from phalanx.launcher.services.ray_cluster import LocalRay, node_resource, running_raylets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _pid() -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_raylet_dead_at_start_up_fails_the_first_work_within_seconds() -> None:
    """... and the agents it had started, orphaned and retitled ``ray::DashboardAgent`` (no
    temp dir left in their command lines), go when the cluster closes: CI saw two outlive
    the launcher after a raylet was SIGKILLed as it started them."""
    with LocalRay(RayConfig(virtual_nodes=2), log_to_driver=False) as cluster:   # starts it
        first = ray.remote(num_cpus=0, max_retries=0)(_pid)
        raylet, *agents = cluster.node_pids(1)
        assert agents, "a raylet starts its dashboard and runtime-env agents"
        # the raylets a stalled start's error counts: the head's and each virtual node's
        assert raylet in running_raylets(cluster._temp_dir)
        assert len(running_raylets(cluster._temp_dir)) == 3
        os.kill(raylet, signal.SIGKILL)
        for agent in agents:                # as an agent slow to notice its raylet's death
            os.kill(agent, signal.SIGSTOP)
        started = time.monotonic()
        refs = [first.options(resources={node_resource(i): 1}).remote() for i in (0, 1)]
        with pytest.raises(ServiceStartError, match=r"1 raylet\(s\) died") as raised:
            cluster.first_work(refs, "probes", timeout_s=60.0)
        assert time.monotonic() - started < 15.0
        # how it died is in the error: the signal, as the launcher reports a lost start
        assert cluster.raylet_exits() == {1: -signal.SIGKILL}
        assert "{1: -9}" in str(raised.value)
        assert all(_alive(agent) for agent in agents)
    deadline = time.monotonic() + 10.0    # SIGKILLed: gone once the kernel has reaped it
    while [agent for agent in agents if _alive(agent)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [agent for agent in agents if _alive(agent)]


def test_a_gcs_dead_as_it_starts_is_started_again_at_once(monkeypatch, tmp_path) -> None:
    """Ray's GCS aborting as it starts (seen: gRPC's ``epoll_wait error: Bad file
    descriptor``, exit -6) ends the attempt as soon as it is gone, not after Ray's 30 s
    wait for its port file; the next attempt starts the cluster and the failure, its
    output and the attempt's logs are kept."""
    from phalanx.launcher.services import ray_cluster

    real = ray_cluster.ray_services.start_ray_process
    killed: list[int] = []

    def spawn(command, process_type, *args, **kwargs):     # Ray's own spawn, then SIGABRT
        info = real(command, process_type, *args, **kwargs)
        if process_type == "gcs_server" and not killed:
            killed.append(info.process.pid)
            os.kill(info.process.pid, signal.SIGABRT)
        return info

    monkeypatch.setattr(ray_cluster.ray_services, "start_ray_process", spawn)
    started = time.monotonic()
    cluster = LocalRay(RayConfig(virtual_nodes=1), log_to_driver=False,
                       failed_logs=tmp_path / "ray-logs")
    with cluster:
        took = time.monotonic() - started
        assert cluster.attempts == 2 and len(killed) == 1
        assert len(running_raylets(cluster._temp_dir)) == 2        # the second start's
    assert "gcs_server exited -6" in cluster.failures[0], cluster.failures
    assert took < 25.0, took             # Ray alone waits 30 s for the dead GCS's port file
    assert (tmp_path / "ray-logs" / "attempt-1" / "gcs_server-spawn-0.err").exists()
