"""The ``Membership`` contract, run against the in-memory fake and a real etcd."""
from __future__ import annotations

import json
import threading

import pytest

from phalanx.configs.errors import LeaseLost, MembershipUnavailable
from phalanx.runtime.base import KEEPERS, Membership, MemberRecord, WatchEvent, encode_member
from phalanx.runtime.commit import KeeperReport
from phalanx.runtime.membership import etcd as etcd_membership
from tests.plugins.etcd import MembershipFactory
from tests.polling import eventually

pytestmark = pytest.mark.contract


def record(worker_id: str, rank: int = 0, step: int = -1) -> MemberRecord:
    return MemberRecord(worker_id=worker_id, rank=rank, node=f"node-{rank}",
                        endpoint=f"127.0.0.1:{7000 + rank}", step=step, extra={"k": [1, 2]})


@pytest.mark.timeout(20)
def test_adapter_implements_the_port(membership_factory: MembershipFactory) -> None:
    assert isinstance(membership_factory(), Membership)


@pytest.mark.timeout(20)
def test_join_members_leave(membership_factory: MembershipFactory) -> None:
    a, b = membership_factory(), membership_factory()
    a.join(record("w1", rank=0), ttl_s=5)
    b.join(record("w2", rank=1), ttl_s=5)

    assert b.members() == {"w1": record("w1", rank=0), "w2": record("w2", rank=1)}

    a.leave()
    assert set(b.members()) == {"w2"}
    a.leave()  # a second leave is a no-op
    assert set(a.members()) == {"w2"}


@pytest.mark.timeout(20)
def test_update_rewrites_the_record(membership_factory: MembershipFactory) -> None:
    a, b = membership_factory(), membership_factory()
    a.join(record("w1"), ttl_s=5)

    a.update(record("w1", step=41))

    assert b.members()["w1"].step == 41


@pytest.mark.timeout(20)
def test_update_before_join_is_lease_lost(membership_factory: MembershipFactory) -> None:
    with pytest.raises(LeaseLost):
        membership_factory().update(record("w1"))


@pytest.mark.timeout(20)
def test_expired_lease_removes_member_and_watcher_sees_delete(
        membership_factory: MembershipFactory) -> None:
    dead, observer = membership_factory(), membership_factory()
    seen: list[WatchEvent] = []
    observer.watch_prefix("members/", seen.append)
    dead.join(record("w1"), ttl_s=1)
    assert eventually(lambda: any(e.kind == "put" for e in seen))

    dead._stop_keepalive()  # type: ignore[attr-defined]  # the process "died"

    assert membership_factory.pass_time_until(lambda: "w1" not in observer.members(),
                                              within_s=1 + 1.0)
    assert eventually(lambda: WatchEvent("delete", "members/w1", b"") in seen)
    with pytest.raises(LeaseLost):
        dead.update(record("w1", step=3))


@pytest.mark.timeout(20)
def test_revoked_lease_is_reported_as_lease_lost(membership_factory: MembershipFactory) -> None:
    member = membership_factory()
    member.join(record("w1"), ttl_s=5)

    membership_factory.force_expire(member)

    with pytest.raises(LeaseLost):
        member.update(record("w1", step=1))
    assert "w1" not in member.members()


@pytest.mark.timeout(20)
def test_watch_sees_put_and_delete_until_cancelled(membership_factory: MembershipFactory) -> None:
    writer, watcher = membership_factory(), membership_factory()
    seen: list[WatchEvent] = []
    barrier: list[WatchEvent] = []
    cancel = watcher.watch_prefix("plan/", seen.append)

    writer.put("plan/1", b"one")
    writer.put("planner", b"outside the prefix")
    writer.delete("plan/1")

    assert eventually(lambda: len(seen) == 2)
    assert seen == [WatchEvent("put", "plan/1", b"one"), WatchEvent("delete", "plan/1", b"")]

    cancel()
    cancel()  # idempotent
    watcher.watch_prefix("plan/", barrier.append)
    writer.put("plan/2", b"two")
    assert eventually(lambda: len(barrier) == 1)
    assert len(seen) == 2


@pytest.mark.timeout(20)
def test_compare_and_swap_fences_on_mod_revision(membership_factory: MembershipFactory) -> None:
    m = membership_factory()
    assert m.compare_and_swap("generation", 0, b"1")       # create if absent
    assert not m.compare_and_swap("generation", 0, b"x")   # ... only once
    first = m.get("generation")
    assert first is not None and first.value == b"1"

    assert m.compare_and_swap("generation", first.mod_revision, b"2")
    assert not m.compare_and_swap("generation", first.mod_revision, b"3")  # stale revision
    now = m.get("generation")
    assert now is not None and now.value == b"2" and now.mod_revision > first.mod_revision
    assert not m.compare_and_swap("absent", now.mod_revision, b"x")
    assert m.get("absent") is None


@pytest.mark.timeout(20)
def test_concurrent_create_if_absent_has_one_winner(membership_factory: MembershipFactory) -> None:
    contenders = [membership_factory() for _ in range(4)]
    results: list[bool] = []
    start = threading.Barrier(len(contenders), timeout=5)

    def race(m: Membership, value: bytes) -> None:
        start.wait()
        results.append(m.compare_and_swap("coordinator", 0, value))

    threads = [threading.Thread(target=race, args=(m, str(i).encode()))
               for i, m in enumerate(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)

    assert sorted(results) == [False, False, False, True]


@pytest.mark.timeout(20)
def test_list_prefix_is_sorted_and_get_returns_mod_revision(
        membership_factory: MembershipFactory) -> None:
    m = membership_factory()
    for key in ("events/c", "events/a", "eventsx", "events/b"):
        m.put(key, key.encode())

    listed = m.list_prefix("events/")

    assert [kv.key for kv in listed] == ["events/a", "events/b", "events/c"]
    for kv in listed:
        assert m.get(kv.key) == kv and kv.value == kv.key.encode()
    m.put("events/a", b"again")
    again = m.get("events/a")
    assert again is not None and again.mod_revision > listed[0].mod_revision
    m.delete("events/a")
    m.delete("events/a")  # absent: no error
    assert m.get("events/a") is None
    assert [kv.key for kv in m.list_prefix("events/")] == ["events/b", "events/c"]


def test_a_listing_longer_than_a_page_is_whole_sorted_and_of_one_revision(
        etcd_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_membership, "LIST_PAGE_KEYS", 3)
    factory = MembershipFactory("etcd", etcd_endpoint)
    try:
        m, writer = factory(), factory()
        for i in range(10):
            m.put(f"members/{i:02d}", b"v1")
        pages = 0
        real_call = m._call          # type: ignore[attr-defined]

        def call(what: str, key: str, fn):   # type: ignore[no-untyped-def]
            nonlocal pages
            pages += what == "list"
            if pages == 2:           # between the first and the second page
                writer.put("members/00", b"v2")
                writer.put("members/99", b"late")
            return real_call(what, key, fn)

        m._call = call               # type: ignore[attr-defined]
        listed = m.list_prefix("members/")
        assert pages == 4            # 3 + 3 + 3 + 1
        assert [kv.key for kv in listed] == [f"members/{i:02d}" for i in range(10)]
        assert {kv.value for kv in listed} == {b"v1"}     # the first page's revision
        assert len(m.list_prefix("members/")) == 11
    finally:
        factory.close()


@pytest.mark.timeout(20)
def test_close_is_idempotent_and_revokes_the_lease(membership_factory: MembershipFactory) -> None:
    a, b = membership_factory(), membership_factory()
    seen: list[WatchEvent] = []
    a.watch_prefix("members/", seen.append)
    a.join(record("w1"), ttl_s=5)

    a.close()
    a.close()

    assert "w1" not in b.members()
    with pytest.raises(MembershipUnavailable):
        a.get("members/w1")
    barrier: list[WatchEvent] = []
    b.watch_prefix("members/", barrier.append)
    b.put("members/late", b"{}")
    assert eventually(lambda: len(barrier) == 1)
    assert WatchEvent("put", "members/late", b"{}") not in seen


@pytest.mark.timeout(20)
def test_put_leased_vanishes_with_the_lease(membership_factory: MembershipFactory) -> None:
    keeper, observer = membership_factory(), membership_factory()
    with pytest.raises(LeaseLost):
        keeper.put_leased("keepers/node0", b'{"x": 1}')
    keeper.join(record("keeper.node0"), ttl_s=5)
    keeper.put_leased("keepers/node0", b'{"x": 2}')
    assert observer.get("keepers/node0").value == b'{"x": 2}'
    keeper.leave()
    assert observer.get("keepers/node0") is None


@pytest.mark.timeout(30)
def test_create_leased_elects_one_holder_until_its_lease_ends(
        membership_factory: MembershipFactory) -> None:
    leader, standby = membership_factory(), membership_factory()
    assert leader.create_leased("coordinator", b"leader", ttl_s=1)
    assert not standby.create_leased("coordinator", b"standby", ttl_s=1)
    found = standby.get("coordinator")
    assert found is not None and found.value == b"leader"
    assert leader.lease_lost == "" and standby.lease_lost == ""

    leader._stop_keepalive()  # type: ignore[attr-defined]  # the leader died

    assert membership_factory.pass_time_until(lambda: standby.get("coordinator") is None,
                                              within_s=1 + 1.0)
    assert standby.create_leased("coordinator", b"standby", ttl_s=1)
    found = leader.get("coordinator")
    assert found is not None and found.value == b"standby"

    membership_factory.force_expire(standby)     # cut off from etcd past its TTL

    assert eventually(lambda: standby.lease_lost != "")
    assert standby.get("coordinator") is None


@pytest.mark.timeout(20)
def test_put_if_writes_plan_and_generation_together_or_neither(
        membership_factory: MembershipFactory) -> None:
    winner, stale = membership_factory(), membership_factory()
    assert winner.compare_and_swap("generation", 0, b"0")
    seen = winner.get("generation")
    assert seen is not None
    # both coordinators read generation 0 at the same revision; the winner fences first
    assert winner.put_if("generation", seen.mod_revision,
                         {"plan/00000001": b"winner", "generation": b"1"})
    assert not stale.put_if("generation", seen.mod_revision,
                            {"plan/00000001": b"stale", "generation": b"1"})

    plan, generation = stale.get("plan/00000001"), stale.get("generation")
    assert plan is not None and plan.value == b"winner"   # the stale writer wrote neither key
    assert generation is not None and generation.value == b"1"
    assert plan.mod_revision == generation.mod_revision   # one transaction, one revision
    assert not stale.put_if("absent", seen.mod_revision, {"plan/00000002": b"x"})
    assert stale.get("plan/00000002") is None
    assert stale.put_if("fresh", 0, {"fresh": b"1", "plan/00000003": b"y"})   # 0: absent
    assert not stale.put_if("fresh", 0, {"plan/00000004": b"z"})
    assert stale.get("plan/00000004") is None


@pytest.mark.timeout(20)
def test_a_node_keepers_ranks_are_members_and_the_newest_record_of_a_rank_counts(
        membership_factory: MembershipFactory) -> None:
    """The ranks a keeper publishes in its ``keepers/<node>`` report (one lease per node)
    are members like those under their own lease; a rank in both counts by its newest
    record (it is moving between them)."""
    keeper, own, reader = membership_factory(), membership_factory(), membership_factory()
    keeper.join(MemberRecord("keeper.node0", -1, "node0", extra={"role": "keeper"}), ttl_s=5)
    relayed = {w: json.loads(encode_member(MemberRecord(w, r, "node0", step=7,
                                                        extra={"time": 20.0})))
               for w, r in (("w0", 0), ("w1", 1))}
    keeper.put_leased(KEEPERS + "node0", KeeperReport("node0", ("h", 1), members=relayed).to_json())
    own.join(MemberRecord("w1", 1, "node0", step=6, extra={"time": 10.0}), ttl_s=5)

    table = reader.members()

    assert set(table) == {"keeper.node0", "w0", "w1"}
    assert table["w0"].step == 7 and table["w1"].step == 7     # the keeper's is newer
    own.update(MemberRecord("w1", 1, "node0", step=8, extra={"time": 30.0}))
    assert reader.members()["w1"].step == 8
    keeper.leave()                                             # the node's lease ends
    assert set(reader.members()) == {"w1"}
