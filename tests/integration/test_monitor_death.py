"""The launcher's Monitor hears of a killed worker when Ray does, not at the end of its
poll: it waited for every rank's call to end (``num_returns`` = all), so a death came back
only when the poll's whole timeout ran out (the drills' "detected in" was 0.108-0.118 s
with the default 0.1 s poll on the demo, 0.029-0.053 s after). A death is reported once:
the dead call is not waited on again (a poll that kept returning it would spin)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from phalanx.configs.schema import RayConfig
from phalanx.launcher.coordination.coordinator import RankSlot
from phalanx.launcher.coordination.monitor import Monitor
from phalanx.launcher.services.ray_cluster import LocalRay
from phalanx.recovery.detection import ActorDied

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
POLL_S = 30.0       # far longer than Ray takes to report a death, even on a loaded machine


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class _Rank:
    def pid(self) -> int:
        return os.getpid()

    def train(self) -> None:
        time.sleep(600)


def test_a_killed_worker_ends_the_poll_at_once_and_is_reported_once() -> None:
    with LocalRay(RayConfig(virtual_nodes=1), log_to_driver=False):
        ranks = [_Rank.remote() for _ in range(2)]  # type: ignore[attr-defined]
        pids = ray.get([r.pid.remote() for r in ranks])
        slots = {i: RankSlot(i, f"w{i}", 0, ranks[i], ranks[i].train.remote()) for i in range(2)}
        monitor = Monitor(1, node_check_s=1e9)
        assert monitor.poll(slots, set(), {}, timeout_s=0.2).signals == []   # both train
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        signals = monitor.poll(slots, set(), {}, timeout_s=POLL_S).signals
        waited = time.monotonic() - started
        assert [(type(s), s.worker_id) for s in signals] == [(ActorDied, "w1")]
        assert waited < POLL_S / 2, waited
        # reported once; rank 0 still trains, so the next poll waits its timeout out
        started = time.monotonic()
        assert monitor.poll(slots, set(), {}, timeout_s=0.5).signals == []
        assert time.monotonic() - started >= 0.4
