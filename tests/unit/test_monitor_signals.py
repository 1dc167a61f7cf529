"""The launcher's Monitor turns a rank's failed collective, reported in its member record,
into a signal: after a grace, once, only in its current generation."""
from __future__ import annotations

import socket
import time

import pytest

from phalanx.launcher.coordination.coordinator import RankSlot
from phalanx.launcher.job import _stale
from phalanx.launcher.coordination.monitor import AWAY_PROBE_S, FINISH_GRACE_S, Monitor
from phalanx.launcher.coordination.node_watch import NodeWatch
from phalanx.configs.errors import WorkerFailed
from phalanx.recovery.detection import (CollectiveError, KeeperLeaseExpired, LeaseLost, NodeLost,
                                       WorkerRaised)
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


def _keeper(node: int) -> MemberRecord:
    return MemberRecord(worker_id=f"keeper.node{node}", rank=-1, node=f"node{node}",
                        extra={"role": "keeper"})


def test_a_node_whose_lease_lapsed_and_which_answers_nothing_is_lost() -> None:
    """A dead host or a cut link closes no socket: its keeper's record vanishing (the
    node's lease) while neither its keeper nor its raylet accepts a connection is a lost
    node; a keeper gone on a node whose raylet answers is not (it is being replaced)."""
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    gone = closed.getsockname()[:2]
    closed.close()
    alive = listening.getsockname()[:2]
    watch = NodeWatch(keepers={0: gone, 1: gone, 2: gone}, raylets={0: alive, 1: gone, 2: gone},
                      secret=b"s", job="job", generation=lambda: 0)
    monitor = Monitor(3, node_check_s=1e9, watch=watch)
    slots = {r: RankSlot(r, f"w{r}", r, None) for r in range(3)}
    members = {"keeper.node0": _keeper(0), "keeper.node1": _keeper(1),
               "keeper.node2": _keeper(2)}
    try:
        assert monitor.poll(slots, set(), members, timeout_s=0).signals == []
        # node 2's lease lapses while etcd is not trusted: nothing yet
        del members["keeper.node2"]
        assert monitor.poll(slots, set(), members, timeout_s=0,
                            leases_trusted=False).signals == []
        del members["keeper.node0"], members["keeper.node1"]
        signals = monitor.poll(slots, set(), members, timeout_s=0).signals
        assert sorted(s.node for s in signals if isinstance(s, NodeLost)) == ["node1", "node2"]
        assert monitor.poll(slots, set(), members, timeout_s=0).signals == []   # once
    finally:
        listening.close()
        watch.close()


def test_ranks_on_a_report_that_stopped_moving_are_not_judged_by_it() -> None:
    """A node keeper rewrites its report (its ranks' records) every heartbeat: a report
    revision that stood still longer than ``report_stale_s`` (the keeper cannot reach etcd)
    makes its ranks' samples excused, so the stall detector does not take a control-plane
    stall for a hung rank; once it moves the samples count again."""
    monitor = Monitor(2, node_check_s=1e9, report_stale_s=0.05)
    slots = {0: RankSlot(0, "w0", 0, None)}

    def sample(revision: int) -> bool:
        record = MemberRecord("w0", 0, "node0", step=5, extra={"report_rev": revision})
        progress = monitor.poll(slots, set(), {"w0": record}, timeout_s=0).progress
        return progress[0].in_step

    assert sample(10) and sample(10)         # just seen: current
    time.sleep(0.1)
    assert not sample(10)                    # stood still past report_stale_s
    assert sample(11)                        # moved: current again
    own = MemberRecord("w0", 0, "node0", step=5)     # under its own lease: always current
    time.sleep(0.1)
    assert monitor.poll(slots, set(), {"w0": own}, timeout_s=0).progress[0].in_step


def test_ranks_whose_keeper_lapsed_on_a_node_that_answers_are_excused() -> None:
    """A slow, lossy link to etcd can lapse a node keeper's lease (and its ranks' records
    with it) while the node trains on: a node that still answers is not lost, its ranks'
    vanished records are no lease loss and no stall while its keeper is away; once the
    keeper reports again a record still missing is a lease loss, and a node that stops
    answering meanwhile is lost at its next probe."""
    listening = socket.create_server(("127.0.0.1", 0))
    alive = listening.getsockname()[:2]
    closed = socket.create_server(("127.0.0.1", 0))
    gone = closed.getsockname()[:2]
    closed.close()
    watch = NodeWatch(keepers={0: alive, 1: alive}, raylets={0: alive, 1: alive},
                      secret=b"s", job="job", generation=lambda: 0)
    monitor = Monitor(2, node_check_s=1e9, watch=watch)
    slots = {r: RankSlot(r, f"w{r}", r, None) for r in range(2)}
    ranks = {"w0": MemberRecord("w0", 0, "node0", step=7, extra={"state": "running"}),
             "w1": MemberRecord("w1", 1, "node1", step=7, extra={"state": "running"})}
    whole = {"keeper.node0": _keeper(0), "keeper.node1": _keeper(1), **ranks}
    lapsed = {k: v for k, v in whole.items() if k not in ("keeper.node1", "w1")}
    try:
        assert monitor.poll(slots, set(), whole, timeout_s=0).signals == []
        for _ in range(3):                   # well past FINISH_GRACE_S: still excused
            result = monitor.poll(slots, set(), lapsed, timeout_s=0)
            assert result.signals == []
            (away,) = [p for p in result.progress if p.rank == 1]
            assert (away.step, away.in_step) == (7, False)
            time.sleep(FINISH_GRACE_S)
        back = {k: v for k, v in whole.items() if k != "w1"}    # keeper back, w1 not
        assert monitor.poll(slots, set(), back, timeout_s=0).signals == []
        time.sleep(FINISH_GRACE_S * 1.2)
        (lost,) = monitor.poll(slots, set(), back, timeout_s=0).signals
        assert isinstance(lost, LeaseLost) and lost.worker_id == "w1"
        # node 0's keeper lapses too, then the node stops answering: lost at a re-probe
        monitor.poll(slots, set(), {k: v for k, v in back.items() if k != "keeper.node0"},
                     timeout_s=0)
        watch._keepers[0] = watch._raylets[0] = gone
        time.sleep(AWAY_PROBE_S)
        signals = monitor.poll(slots, set(), {"w0": ranks["w0"]}, timeout_s=0).signals
        assert [s.node for s in signals if isinstance(s, NodeLost)] == ["node0"]
    finally:
        listening.close()
        watch.close()


def test_a_rank_that_raised_after_its_record_left_is_a_fault_not_a_failed_job() -> None:
    """A rank whose script raised closes its session (its record leaves etcd) before its
    call's error reaches the launcher: it had joined, so it is replaced; a rank that raised
    without ever having a record fails the job (its set-up fails again in a replacement)."""
    monitor = Monitor(2, node_check_s=1e9)
    poll(monitor, {"w0": worker(0, 1), "w1": worker(1, 1)})          # both joined
    slot = RankSlot(1, "w1", 0, None)
    error = WorkerFailed(1, "InjectedFault: drill", "Traceback ...\nInjectedFault: drill")
    raised = monitor._raised(error, slot, {"w0": worker(0, 1)}, time.monotonic())
    assert isinstance(raised, WorkerRaised) and raised.rank == 1
    with pytest.raises(WorkerFailed):          # the same step raising again is a bug
        monitor._raised(error, slot, {"w0": worker(0, 1)}, time.monotonic())
    with pytest.raises(WorkerFailed):          # never joined
        Monitor(2, node_check_s=1e9)._raised(error, slot, {}, time.monotonic())
