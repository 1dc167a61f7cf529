"""A keeper writes durable state only while etcd confirms its generation: paused while
etcd is unreachable, fenced for good once the job moved on without it past the grace."""
from __future__ import annotations

import pytest

from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.membership.generation import GENERATION_KEY
from phalanx.runtime.keeper.fence import KeeperFence
from tests.fakes.membership_memory import InMemoryMembership

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_keeper_given_the_current_generation_writes() -> None:
    membership, clock = InMemoryMembership(), Clock()
    membership.put(GENERATION_KEY, b"3")
    fence = KeeperFence(membership, "node0", grace_s=6, clock=clock)
    assert not fence.may_write()          # still at generation 0: behind
    fence.given(3)
    assert fence.may_write() and not fence.fenced


def test_behind_within_the_grace_pauses_then_the_new_generation_resumes() -> None:
    membership, clock = InMemoryMembership(), Clock()
    membership.put(GENERATION_KEY, b"1")
    fence = KeeperFence(membership, "node0", grace_s=6, clock=clock)
    fence.given(1)
    assert fence.may_write()
    membership.put(GENERATION_KEY, b"2")  # a recovery fenced generation 2
    clock.now = 1.0
    assert not fence.may_write() and not fence.fenced
    fence.given(2)                         # the coordinator placed this keeper again
    assert fence.may_write()


def test_left_behind_past_the_grace_is_fenced_for_good() -> None:
    membership, clock = InMemoryMembership(), Clock()
    membership.put(GENERATION_KEY, b"1")
    fence = KeeperFence(membership, "node1", grace_s=6, clock=clock)
    fence.given(1)
    membership.put(GENERATION_KEY, b"2")
    for clock.now in (1.0, 4.0, 7.5):
        assert not fence.may_write()
    assert fence.fenced
    fence.given(2)                         # too late: a fenced keeper stays silent
    clock.now = 9.0
    assert not fence.may_write()


def test_etcd_unreachable_pauses_writes_without_fencing(monkeypatch: pytest.MonkeyPatch) -> None:
    membership, clock = InMemoryMembership(), Clock()
    membership.put(GENERATION_KEY, b"1")
    fence = KeeperFence(membership, "node0", grace_s=6, clock=clock)
    fence.given(1)

    def down(key: str) -> None:
        raise MembershipUnavailable("etcd down")

    monkeypatch.setattr(membership, "get", down)
    for clock.now in (1.0, 5.0, 20.0):
        assert not fence.may_write()
    assert not fence.fenced
    monkeypatch.undo()
    clock.now = 21.0
    assert fence.may_write()
