"""The commit point when a job ends (``CommitTracker.settle``): written even when not due,
once it reaches the newest step every rank holds, or after its bound; the tiers gate
their markers on it, so without it a finished job's last checkpoint would never commit."""
from __future__ import annotations

import pytest

from phalanx.launcher.coordination.commit_tracker import CommitTracker
from phalanx.runtime.base import read_table
from phalanx.runtime.commit import COMMIT_KEY, KeeperReport, committed_from
from phalanx.runtime.keeper.reporter import KEEPERS
from tests.fakes.membership_memory import InMemoryMembership

pytestmark = pytest.mark.unit


def _report(node: str, local: dict, replicas: dict) -> bytes:
    return KeeperReport(node=node, address=(node, 1), local=local,
                        replicas=replicas).to_json()


def _commit(membership: InMemoryMembership) -> int:
    kv = membership.get(COMMIT_KEY)
    return committed_from(kv.value if kv else None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_settle_writes_the_final_commit_point_once_the_replicas_land() -> None:
    membership, clock = InMemoryMembership(), Clock()
    tracker = CommitTracker(membership, 2, 1, every_steps=1000, every_s=1e9)
    membership.put(KEEPERS + "n0", _report("n0", {0: (10,)}, {1: (10,)}))
    membership.put(KEEPERS + "n1", _report("n1", {1: (10,)}, {0: (10,)}))
    tracker.poll(clock())
    assert tracker.committed == 10 and _commit(membership) == -1    # not due: not written
    membership.put(KEEPERS + "n0", _report("n0", {0: (10, 20)}, {1: (10,)}))
    membership.put(KEEPERS + "n1", _report("n1", {1: (10, 20)}, {0: (10, 20)}))
    clock.sleep(1.0)
    tracker.poll(clock())
    assert tracker.committed == 10                    # rank 1's replica of 20: not yet

    def land_then_sleep(seconds: float) -> None:     # rank 1's replica lands a poll later
        membership.put(KEEPERS + "n0", _report("n0", {0: (10, 20)}, {1: (10, 20)}))
        clock.sleep(seconds)
    assert tracker.settle(2.0, clock=clock, sleep=land_then_sleep) == 20
    assert _commit(membership) == 20                  # written though not due
    assert clock.now < 102.0                          # did not wait out its bound


def test_settle_is_bounded_when_a_step_never_commits() -> None:
    membership, clock = InMemoryMembership(), Clock()
    tracker = CommitTracker(membership, 2, 1, every_steps=1000, every_s=1e9)
    membership.put(KEEPERS + "n0", _report("n0", {0: (10, 20)}, {1: (10,)}))
    membership.put(KEEPERS + "n1", _report("n1", {1: (10, 20)}, {0: (10, 20)}))
    assert tracker.settle(1.5, clock=clock, sleep=clock.sleep) == 10
    assert _commit(membership) == 10 and 101.5 <= clock.now < 102.5


def test_a_poll_given_the_watch_loops_read_of_the_table_uses_it() -> None:
    """The launcher's watch loop reads the keepers' reports and the members for itself and
    hands that read to the tracker, which then does not read them again."""
    membership, clock = InMemoryMembership(), Clock()
    tracker = CommitTracker(membership, 2, 1, every_steps=1, every_s=1e9)
    membership.put(KEEPERS + "n0", _report("n0", {0: (10,)}, {1: (10,)}))
    membership.put(KEEPERS + "n1", _report("n1", {1: (10,)}, {0: (10,)}))
    table = read_table(membership)
    membership.put(KEEPERS + "n0", _report("n0", {0: (10, 20)}, {1: (10, 20)}))
    membership.put(KEEPERS + "n1", _report("n1", {1: (10, 20)}, {0: (10, 20)}))
    assert tracker.poll(clock(), table=table) == 10     # what the given read says
    assert _commit(membership) == 10
    clock.sleep(1.0)
    assert tracker.poll(clock()) == 20                  # no read given: etcd's now
