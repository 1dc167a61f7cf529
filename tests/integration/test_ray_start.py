"""The local Ray's start-up probe (``LocalRay._probe_nodes``): a raylet that dies while its
node's first worker starts fails the attempt within seconds (the launcher then starts Ray
again), not after the probe's whole timeout. Seen on a loaded 2-core machine: a raylet
SIGKILLed at start-up cost a minute of waiting for a probe that could never run."""
from __future__ import annotations

import os
import signal
import time

import pytest

from phalanx.configs.errors import ServiceStartError
from phalanx.configs.schema import RayConfig
from phalanx.launcher.services.ray_cluster import LocalRay

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_raylet_dead_at_start_up_fails_the_probe_within_seconds() -> None:
    with LocalRay(RayConfig(virtual_nodes=2), log_to_driver=False).start() as cluster:
        raylet = cluster.node_pids(1)[0]
        os.kill(raylet, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ServiceStartError, match=r"1 raylet\(s\) died") as raised:
            cluster._probe_nodes(timeout_s=60.0)          # noqa: SLF001
        assert time.monotonic() - started < 15.0
        # how it died is in the error: the signal, as the launcher reports a lost start
        assert cluster.raylet_exits() == {1: -signal.SIGKILL}
        assert "{1: -9}" in str(raised.value)
