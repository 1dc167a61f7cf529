"""The launcher's Monitor turns a rank's failed collective, reported in its member record,
into a signal: after a grace, once, only in its current generation."""
from __future__ import annotations

import time

from phalanx.launcher.coordination.coordinator import RankSlot
from phalanx.launcher.job import _stale
from phalanx.launcher.coordination.monitor import Monitor
from phalanx.recovery.detection import CollectiveError, KeeperLeaseExpired, NodeLost
from phalanx.runtime.base import MemberRecord

GRACE_S = 0.05


def worker(rank: int, generation: int, error_generation: int | None = None) -> MemberRecord:
    extra = {"state": "running"}
    if error_generation is not None:
        extra["collective_error"] = {"generation": error_generation, "detail": "peer reset"}
    return MemberRecord(worker_id=f"w{rank}", rank=rank, node="node0", step=5,
                        generation=generation, extra=extra)


def poll(monitor: Monitor, members: dict[str, MemberRecord]) -> list:
    slots = {r: RankSlot(r, f"w{r}", 0, None) for r in range(2)}
    return monitor.poll(slots, set(), members, timeout_s=0).signals


def test_a_failed_collective_is_a_signal_once_after_the_grace() -> None:
    monitor = Monitor(2, node_check_s=1e9, collective_grace_s=GRACE_S)
    members = {"w0": worker(0, 2, error_generation=2), "w1": worker(1, 2)}
    assert poll(monitor, members) == []                  # within the grace
    time.sleep(GRACE_S * 2)
    signals = poll(monitor, members)
    assert len(signals) == 1 and isinstance(signals[0], CollectiveError)
    assert (signals[0].reporting_rank, signals[0].generation) == (0, 2)
    assert "peer reset" in signals[0].detail
    time.sleep(GRACE_S * 2)
    assert poll(monitor, members) == []                  # reported once


def test_an_error_of_an_older_generation_is_no_signal() -> None:
    monitor = Monitor(2, node_check_s=1e9, collective_grace_s=GRACE_S)
    members = {"w0": worker(0, 3, error_generation=2)}   # it already re-formed
    poll(monitor, members)
    time.sleep(GRACE_S * 2)
    assert poll(monitor, members) == []


def test_signals_about_handled_nodes_and_old_generations_are_stale() -> None:
    live = {"node0"}
    assert _stale(NodeLost("node1", 0.0), live, 3, False)
    assert _stale(KeeperLeaseExpired("node1", 0.0), live, 3, False)
    assert not _stale(KeeperLeaseExpired("node0", 0.0), live, 3, False)
    assert _stale(CollectiveError(0, 0.0, "", generation=2), live, 3, False)
    assert not _stale(CollectiveError(0, 0.0, "", generation=3), live, 3, False)
    # a recovery in progress or parked explains every failed collective
    assert _stale(CollectiveError(0, 0.0, "", generation=3), live, 3, True)
