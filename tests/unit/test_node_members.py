"""The keeper's table of its node's ranks' member records (one lease per node): a rank
silent past its TTL is dropped as its own lease would lapse, a rank that left is dropped
once its last record was published, and a rank the keeper forgot must join again."""
from __future__ import annotations

from phalanx.runtime.keeper.members import NodeMembers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rec(worker: str, step: int) -> dict:
    return {"worker_id": worker, "rank": 0, "node": "node0", "step": step}


def test_a_joined_rank_is_held_and_published_until_silent_past_its_ttl() -> None:
    clock = Clock()
    table = NodeMembers(clock)
    assert table.beat("w0", rec("w0", 1), 3.0, join=True) == {"known": True, "published": False}
    assert table.urgent.is_set()          # a join is published at once
    rows, versions = table.current()
    assert rows == {"w0": rec("w0", 1)}
    table.published(versions)
    assert table.beat("w0", None, 3.0) == {"known": True, "published": True}
    clock.now += 2.9
    assert table.beat("w0", None, 3.0)["known"]      # a bare beat keeps it alive
    clock.now += 3.1
    assert table.current()[0] == {}                  # silent past its TTL: dropped
    assert table.beat("w0", rec("w0", 2), 3.0) == {"known": False, "published": False}
    assert table.current()[0] == {}                  # an update does not bring it back
    assert table.beat("w0", rec("w0", 2), 3.0, join=True)["known"]
    assert table.current()[0] == {"w0": rec("w0", 2)}


def test_a_lapsed_rank_is_unknown_even_before_the_reporter_looked() -> None:
    clock = Clock()
    table = NodeMembers(clock)
    table.beat("w0", rec("w0", 1), 1.0, join=True)
    clock.now += 1.5
    assert not table.beat("w0", None, 1.0)["known"]


def test_a_changed_record_is_unpublished_until_the_reporter_wrote_that_version() -> None:
    table = NodeMembers(Clock())
    table.beat("w0", rec("w0", 1), 3.0, join=True)
    _, first = table.current()
    table.beat("w0", rec("w0", 2), 3.0)              # changed after the reporter read it
    table.published(first)
    assert not table.beat("w0", None, 3.0)["published"]
    rows, second = table.current()
    table.published(second)
    assert rows["w0"]["step"] == 2 and table.beat("w0", None, 3.0)["published"]


def test_a_rank_that_left_is_dropped_once_its_last_record_was_published() -> None:
    table = NodeMembers(Clock())
    table.beat("w0", rec("w0", 1), 3.0, join=True)
    table.beat("w1", rec("w1", 1), 3.0, join=True)
    table.published(table.current()[1])
    table.beat("w0", {**rec("w0", 2), "extra": {"state": "finished"}}, 3.0)
    table.urgent.clear()
    table.leave("w0")
    table.leave("w1")                                # published already: gone at once
    assert table.urgent.is_set()
    rows, versions = table.current()
    assert set(rows) == {"w0"} and rows["w0"]["extra"] == {"state": "finished"}
    table.published(versions)
    assert table.current()[0] == {}
