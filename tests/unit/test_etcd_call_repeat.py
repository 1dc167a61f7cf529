"""The etcd client's repeat of a call whose member stopped answering: once on each member
at most, in the order the failovers leave them (a member whose cluster is still electing a
leader times out like a dead one, and the next is asked). The members are stand-ins that
answer or time out as told; the real 3-member cluster is tests/integration/test_etcd_failover."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.membership.etcd import EtcdMembership


class _TimedOut(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "Deadline Exceeded"


class _Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self) -> str:
        return "permission denied"


class _Member:
    def __init__(self, host: str) -> None:
        self.host = host

    def close(self) -> None:
        pass


def _membership(monkeypatch: pytest.MonkeyPatch) -> EtcdMembership:
    membership = EtcdMembership(["a:1", "b:2", "c:3"], "/phalanx/t/", timeout_s=0.1)
    monkeypatch.setattr(membership, "_open", lambda host, port: _Member(host))
    return membership


def test_a_call_goes_to_each_member_in_turn_until_one_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    membership = _membership(monkeypatch)
    asked: list[str] = []

    def put(member: Any) -> str:
        asked.append(member.host)
        if member.host != "c":       # a dead, then a leaderless member
            raise _TimedOut()
        return "written"

    assert membership._call("put", "k", put) == "written"
    assert asked == ["a", "b", "c"]
    assert membership.endpoint == "c:3"


def test_the_repeat_uses_again_and_every_member_failing_raises_after_one_try_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    membership = _membership(monkeypatch)
    asked: list[tuple[str, str]] = []

    def first(member: Any) -> None:
        asked.append(("first", member.host))
        raise _TimedOut()

    def again(member: Any) -> None:
        asked.append(("again", member.host))
        raise _TimedOut()

    with pytest.raises(MembershipUnavailable, match="DEADLINE_EXCEEDED"):
        membership._call("txn", "k", first, again)
    assert asked == [("first", "a"), ("again", "b"), ("again", "c")]


def test_a_member_that_answers_with_an_error_is_not_asked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    membership = _membership(monkeypatch)
    asked: list[str] = []

    def put(member: Any) -> None:
        asked.append(member.host)
        raise _Refused()

    with pytest.raises(MembershipUnavailable, match="PERMISSION_DENIED"):
        membership._call("put", "k", put)
    assert asked == ["a"] and membership.endpoint == "a:1"
