"""The global commit point computed from keeper reports (pure)."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.runtime.commit import (COMMIT_KEY, KeeperReport, commit_value, committed_from,
                                    committed_step)
from phalanx.runtime.keeper.reporter import KeeperReporter, keeper_member
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore

pytestmark = pytest.mark.unit


def report(node: str, local: dict[int, tuple[int, ...]], replicas: dict[int, tuple[int, ...]]):
    return KeeperReport(node=node, address=("127.0.0.1", 1), local=local, replicas=replicas)


@pytest.mark.timeout(10)
def test_commit_needs_every_rank_on_f_plus_one_keepers() -> None:
    reports = {
        "a": report("a", {0: (4, 5)}, {1: (4,)}),
        "b": report("b", {1: (4, 5)}, {0: (4, 5)}),
    }
    assert committed_step(reports, [0, 1], factor=1) == 4  # rank 1's step 5 not replicated
    assert committed_step(reports, [0, 1], factor=0) == 5
    assert committed_step(reports, [0, 1, 2], factor=0) == -1  # rank 2 held nowhere
    assert committed_step({}, [0], factor=1) == -1


def holders_of(reports: dict[str, KeeperReport], rank: int, step: int) -> list[str]:
    """Keepers holding (rank, step), own or replica: written out independently here."""
    return [n for n, r in reports.items()
            if step in r.local.get(rank, ()) or step in r.replicas.get(rank, ())]


@pytest.mark.timeout(30)
@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from("abcd"),
                       st.tuples(st.dictionaries(st.integers(0, 3), st.sets(st.integers(0, 6))),
                                 st.dictionaries(st.integers(0, 3), st.sets(st.integers(0, 6)))),
                       max_size=4),
       st.integers(0, 2))
def test_committed_step_is_held_by_enough_keepers(raw, factor) -> None:
    reports = {n: report(n, {r: tuple(sorted(s)) for r, s in loc.items()},
                         {r: tuple(sorted(s)) for r, s in rep.items()})
               for n, (loc, rep) in raw.items()}
    ranks = [0, 1, 2, 3]
    step = committed_step(reports, ranks, factor)
    if step >= 0:
        for rank in ranks:
            assert len(holders_of(reports, rank, step)) >= factor + 1
    newer = {s for r in reports.values() for steps in (*r.local.values(), *r.replicas.values())
             for s in steps if s > step}
    for candidate in newer:  # no newer step qualifies
        assert any(len(holders_of(reports, rank, candidate)) < factor + 1 for rank in ranks)


@pytest.mark.timeout(10)
def test_report_json_round_trip() -> None:
    original = report("a", {0: (1, 2)}, {3: (2,)})
    assert KeeperReport.from_json(original.to_json()) == original


@pytest.mark.parametrize("value, step", [
    (commit_value(42, 1.0), 42), (None, -1), (b"", -1), (b"not json", -1), (b"[1]", -1),
    (b'{"step": "7"}', -1), (b'{"step": -3}', -1), (b'{"step": true}', -1),
])
def test_committed_from_reads_only_a_well_formed_commit(value, step) -> None:
    assert committed_from(value) == step


def test_the_reporter_hands_the_commit_it_reads_back_to_its_keeper() -> None:
    membership = InMemoryMembership(InMemoryStore())
    heard: list[int] = []
    reporter = KeeperReporter(membership, "node0", lambda: KeeperReport("node0", ("h", 1)),
                              heartbeat_s=0.01, ttl_s=1.0,
                              member=keeper_member("node0", ("h", 1), 1), on_commit=heard.append)
    reporter.start()
    try:
        assert heard == [-1]                     # nothing committed yet
        membership.put(COMMIT_KEY, commit_value(12, 0.0))
        deadline = time.monotonic() + 5
        while 12 not in heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 12 in heard
    finally:
        reporter.close()
