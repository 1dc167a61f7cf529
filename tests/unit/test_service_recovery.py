"""What rides out a service fault, with fakes: the launcher's etcd outage tracker and the
Monitor's lease grace, a worker's keeper link that skips snapshots while its keeper is
gone and moves to the successor, and the node watch telling a lost keeper from a lost node."""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from phalanx.configs.errors import MembershipUnavailable, PeerUnreachable
from phalanx.launcher.coordination.coordinator import RankSlot
from phalanx.launcher.services.etcd_outage import EtcdOutage, outage_grace_s
from phalanx.launcher.coordination.monitor import Monitor, PollResult
from phalanx.launcher.coordination.node_watch import NodeWatch
from phalanx.recovery.detection import LeaseLost
from phalanx.runtime.base import MEMBERS, KeyValue, MemberRecord, encode_member
from phalanx.runtime.worker.keeper_link import KeeperLink, keeper_address
from tests.fakes.membership_memory import InMemoryMembership
from phalanx.runtime.commit import KeeperReport
from phalanx.runtime.transport.tcp import FrameServer, Reply

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"s" * 32
JOB = "svcjob"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FlakyMembership:
    """The member table's reads answer or raise MembershipUnavailable, as the test says;
    ``reads`` counts the range reads."""

    def __init__(self) -> None:
        self.up = True
        self.reads = 0
        self.table = {"w0": MemberRecord(worker_id="w0", rank=0, node="node0", step=3)}

    def list_prefix(self, prefix: str) -> list[KeyValue]:
        self.reads += 1
        if not self.up:
            raise MembershipUnavailable("etcd 127.0.0.1:1 list failed: UNAVAILABLE")
        if prefix != MEMBERS:
            return []
        return [KeyValue(f"{MEMBERS}{w}", encode_member(r), 1) for w, r in self.table.items()]


def test_outage_serves_the_last_table_then_distrusts_keys_for_the_grace() -> None:
    membership, clock, events, resets = FlakyMembership(), Clock(), [], []
    outage = EtcdOutage(membership, lambda e, **f: events.append((e, f)), grace_s=6.0,  # type: ignore[arg-type]
                        on_untrusted=lambda: resets.append(clock.now), budget_s=30.0,
                        clock=clock)
    assert outage.members() == membership.table and outage.trusted() and not resets
    membership.up = False
    clock.now += 1
    assert outage.members() == membership.table        # the last good read
    assert not outage.trusted() and [e for e, _ in events] == ["etcd_unreachable"]
    clock.now += 2.5
    membership.up = True
    membership.table = {}                               # keys not back yet
    assert outage.members() == {}
    assert [e for e, _ in events] == ["etcd_unreachable", "etcd_reachable"]
    assert events[1][1]["down_s"] == pytest.approx(2.5)
    assert not outage.trusted()                         # in the grace period
    clock.now += 6.0
    outage.members()
    assert outage.trusted() and resets == [101.0, 103.5] and outage.outages == 1


def test_the_table_is_read_again_after_the_interval_or_when_asked_for_a_fresh_one() -> None:
    membership, clock = FlakyMembership(), Clock()
    outage = EtcdOutage(membership, lambda e, **f: None, grace_s=1.0,  # type: ignore[arg-type]
                        min_interval_s=0.25, clock=clock)
    assert outage.members() == membership.table and membership.reads == 2
    membership.table = {}
    clock.now += 0.1
    assert outage.members() != {} and membership.reads == 2        # the last read
    assert outage.members(fresh=True) == {} and membership.reads == 4
    membership.table = {"w1": MemberRecord(worker_id="w1", rank=1, node="node1", step=5)}
    clock.now += 0.25
    assert outage.members() == membership.table and membership.reads == 6
    membership.up = False      # found at the next read; then asked at every poll, table kept
    clock.now += 0.1
    assert outage.members() == membership.table and membership.reads == 6 and outage.trusted()
    clock.now += 0.2
    assert outage.members() == membership.table and membership.reads == 7
    assert outage.members() == membership.table and membership.reads == 8
    assert not outage.trusted()


def test_an_outage_past_the_budget_ends_the_job() -> None:
    membership, clock = FlakyMembership(), Clock()
    outage = EtcdOutage(membership, lambda e, **f: None, grace_s=1.0, budget_s=10.0,  # type: ignore[arg-type]
                        clock=clock)
    membership.up = False
    outage.members()
    clock.now += 9
    outage.members()
    clock.now += 2
    with pytest.raises(MembershipUnavailable, match="longer than the launcher rides out"):
        outage.members()


def test_grace_covers_a_lease_regranted_after_the_outage() -> None:
    assert outage_grace_s(3.0) == 6.0


def _lease_signals(monitor: Monitor, members: dict[str, MemberRecord],
                   trusted: bool) -> list[Any]:
    slots = {0: RankSlot(0, "w0", 0, None)}
    result = PollResult()
    monitor._lease_signals(slots, set(), members, time.monotonic(), result, set,  # noqa: SLF001
                           trusted)
    return result.signals


def test_a_vanished_key_counts_only_once_keys_are_trusted_again(monkeypatch) -> None:
    monkeypatch.setattr("phalanx.launcher.coordination.monitor.FINISH_GRACE_S", 0.05)
    monitor = Monitor(1, node_check_s=1e9)
    record = MemberRecord(worker_id="w0", rank=0, node="node0", step=3)
    assert _lease_signals(monitor, {"w0": record}, trusted=True) == []
    for _ in range(3):                       # etcd just came back: the key is not there yet
        time.sleep(0.06)
        assert _lease_signals(monitor, {}, trusted=False) == []
    assert _lease_signals(monitor, {}, trusted=True) == []    # the timer starts now
    time.sleep(0.06)
    signals = _lease_signals(monitor, {}, trusted=True)
    assert len(signals) == 1 and isinstance(signals[0], LeaseLost)


# -- the worker's keeper link --------------------------------------------------------------

class FakeClient:
    def __init__(self, address: tuple[str, int], alive: bool = True) -> None:
        self.address_tuple, self.alive, self.closed = address, alive, False
        self.generation = 0
        self.dropped: list[tuple[int, int | None]] = []

    @property
    def address(self) -> str:
        return f"{self.address_tuple[0]}:{self.address_tuple[1]}"

    def ping(self) -> dict:
        if not self.alive:
            raise PeerUnreachable(f"{self.address}: connection refused")
        return {}

    def drop(self, rank: int, above_step: int | None = None) -> dict:
        if not self.alive:
            raise PeerUnreachable(f"{self.address}: connection refused")
        self.dropped.append((rank, above_step))
        return {}

    def close(self) -> None:
        self.closed = True


class FakeSnapshotter:
    def __init__(self) -> None:
        self.captured: list[int] = []
        self.skipped: list[int] = []
        self.clients: list[FakeClient] = []
        self.fail_next = False

    def capture(self, step: int, objects: Any) -> float:
        if self.fail_next:
            self.fail_next = False
            raise PeerUnreachable("127.0.0.1:1: connection reset before the reply to op=claim")
        self.captured.append(step)
        return 0.0

    def skip(self, step: int) -> None:
        self.skipped.append(step)

    def use_client(self, client: FakeClient) -> None:
        self.clients.append(client)


def test_keeper_link_skips_while_the_keeper_is_gone_then_moves_to_its_successor() -> None:
    clock, old = Clock(), FakeClient(("127.0.0.1", 1000))
    live = {("127.0.0.1", 1000): False, ("127.0.0.1", 2000): True}
    opened: list[FakeClient] = []

    def open_client(host: str, port: int, timeout: float | None) -> FakeClient:
        opened.append(FakeClient((host, port), live[(host, port)]))
        return opened[-1]

    where: list[tuple[str, int] | None] = [None]
    link = KeeperLink(old, open_client, lambda: where[0], retry_s=0.25,  # type: ignore[arg-type]
                      clock=clock)
    snap = FakeSnapshotter()
    assert link.capture(snap, 1, {}) and snap.captured == [1]       # type: ignore[arg-type]
    snap.fail_next = True
    assert not link.capture(snap, 2, {}) and link.down and old.closed  # type: ignore[arg-type]
    where[0] = ("127.0.0.1", 1000)                # etcd still names the dead keeper
    clock.now += 0.1
    assert not link.capture(snap, 3, {}) and opened == []          # type: ignore[arg-type]
    clock.now += 0.2
    assert not link.capture(snap, 4, {}) and len(opened) == 1      # type: ignore[arg-type]
    link.drop(0, above_step=3)                    # nothing to drop on a keeper that is gone
    where[0] = ("127.0.0.1", 2000)                # the new keeper reported itself
    clock.now += 0.3
    assert link.capture(snap, 5, {})              # type: ignore[arg-type]
    assert snap.skipped == [2, 3, 4] and snap.captured == [1, 5]
    assert snap.clients == [opened[-1]] and link.client is opened[-1] and not link.down
    assert opened[-2].closed and link.reconnects == 1 and link.skipped == 3
    link.drop(0, above_step=5)
    assert opened[-1].dropped == [(0, 5)]


def test_keeper_address_reads_the_nodes_report() -> None:
    membership = InMemoryMembership()
    assert keeper_address(membership, "node1") is None
    membership.put("keepers/node1", KeeperReport("node1", ("127.0.0.1", 4321)).to_json())
    assert keeper_address(membership, "node1") == ("127.0.0.1", 4321)
    membership.put("keepers/node1", b"{not json")
    assert keeper_address(membership, "node1") is None
    assert keeper_address(None, "node1") is None


# -- the node watch: a lost keeper on a live node, and its successor watched ----------------

def _wait(predicate: Any, within_s: float) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.01)
    return predicate()


def test_node_watch_reports_a_lost_keeper_and_watches_its_successor() -> None:
    first = FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=lambda r: Reply({})).start()
    raylet = socket.create_server(("127.0.0.1", 0))
    watch = NodeWatch({0: first.address}, {0: raylet.getsockname()}, SECRET, JOB,
                      lambda: 0).start()
    second = None
    try:
        assert watch.watched == [0]
        first.close()                              # the keeper process is gone
        gone = _wait(watch.keepers_gone, 5.0)
        assert [node for node, _ in gone] == [0] and watch.drain() == []
        second = FrameServer("127.0.0.1", secret=SECRET, job=JOB,
                             handler=lambda r: Reply({})).start()
        watch.rewatch(0, second.address)
        assert _wait(lambda: watch.watched == [0], 5.0)
        assert watch.keepers_gone() == [] and watch.drain() == []
    finally:
        watch.close()
        raylet.close()
        if second is not None:
            second.close()


# -- the launcher's keeper restarts, with Ray faked ------------------------------------------

class FakeRef:
    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class FakeMethod:
    def __init__(self, ref: FakeRef) -> None:
        self.ref = ref

    def remote(self, *args: Any) -> FakeRef:
        return self.ref


class FakeKeeperActor:
    def __init__(self, address: tuple[str, int], dead: bool = False) -> None:
        from ray.exceptions import RayActorError
        error = RayActorError() if dead else None
        self.pid = FakeMethod(FakeRef(1234, error))
        self.address = FakeMethod(FakeRef(list(address), error))


class FakeCoordinator:
    def __init__(self) -> None:
        self.live_nodes = {0, 1}
        self.run_dir = "/tmp/run"
        self.placed = 0
        self.emitted: list[tuple[str, dict]] = []
        self.events = self

    def emit(self, event: str, **fields: Any) -> None:
        self.emitted.append((event, fields))

    def place(self, slots: Any) -> None:
        self.placed += 1


class FakeWatch:
    def __init__(self) -> None:
        self.gone: list[tuple[int, float]] = []
        self.rewatched: list[tuple[int, tuple[str, int]]] = []

    def keepers_gone(self) -> list[tuple[int, float]]:
        gone, self.gone = self.gone, []
        return gone

    def rewatch(self, node: int, address: tuple[str, int]) -> None:
        self.rewatched.append((node, address))


def _fake_ray(monkeypatch: pytest.MonkeyPatch, started: list, raylets: dict) -> None:
    import phalanx.launcher.coordination.keeper_restart as kr

    def get(ref: FakeRef, timeout: float | None = None) -> Any:
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(kr.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(kr.ray, "get", get)
    monkeypatch.setattr(kr.ray, "kill", lambda actor, no_restart: None)
    monkeypatch.setattr(kr, "raylet_addresses", lambda count: raylets)
    monkeypatch.setattr(kr, "refuses", lambda address: False)
    monkeypatch.setattr(kr, "remove_stale", lambda shm_dir, prefix: ["a", "b"])

    def start(cfg: Any, node: int, *args: Any) -> FakeKeeperActor:
        started.append((node, args[-1]))
        return FakeKeeperActor(("127.0.0.1", 9000 + node))
    monkeypatch.setattr(kr, "start_keeper_actor", start)


def test_a_keeper_gone_on_a_live_node_is_replaced_and_placement_sent_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.configs.loader import load_config
    from phalanx.launcher.coordination.keeper_restart import KeeperRestarts

    started: list = []
    _fake_ray(monkeypatch, started, {0: ("127.0.0.1", 1), 1: ("127.0.0.1", 2)})
    cfg = load_config(ROOT / "configs/demo.yaml")
    keepers = {0: (FakeKeeperActor(("127.0.0.1", 100)), ("127.0.0.1", 100)),
               1: (FakeKeeperActor(("127.0.0.1", 101), dead=True), ("127.0.0.1", 101))}
    slots = {r: RankSlot(r, f"w{r}", r % 2, None) for r in range(4)}
    coordinator, watch, registered = FakeCoordinator(), FakeWatch(), []
    restarts = KeeperRestarts(cfg, keepers, coordinator, slots, watch,  # type: ignore[arg-type]
                              "00" * 32, ["127.0.0.1:1"], registered.append)
    watch.gone.append((1, 0.0))
    restarts.poll()              # node 1 noticed (watch), its replacement started
    restarts.poll()              # ... and installed once its address answered
    assert started == [(1, [1, 3])] and len(registered) == 1
    assert keepers[1][1] == ("127.0.0.1", 9001) and keepers[1][0] is registered[0]
    assert watch.rewatched == [(1, ("127.0.0.1", 9001))] and coordinator.placed == 1
    assert [e for e, _ in coordinator.emitted] == ["keeper_lost", "keeper_restarted"]
    assert coordinator.emitted[0][1]["shm_files_removed"] == 2 and restarts.restarts == 1


@pytest.mark.parametrize("raylets,restarted", [
    pytest.param({0: ("127.0.0.1", 1), 1: ("127.0.0.1", 2)}, [(1, [])], id="node-alive"),
    pytest.param({0: ("127.0.0.1", 1)}, [], id="node-gone"),
])
def test_ray_reporting_a_keeper_dead_restarts_it_only_on_a_live_node(
        monkeypatch: pytest.MonkeyPatch, raylets: dict, restarted: list) -> None:
    from phalanx.configs.loader import load_config
    from phalanx.launcher.coordination.keeper_restart import KeeperRestarts

    started: list = []
    _fake_ray(monkeypatch, started, raylets)
    cfg = load_config(ROOT / "configs/demo.yaml")
    keepers = {n: (FakeKeeperActor(("127.0.0.1", 100 + n), dead=n == 1), ("127.0.0.1", 100 + n))
               for n in (0, 1)}
    coordinator = FakeCoordinator()
    restarts = KeeperRestarts(cfg, keepers, coordinator, {}, None,  # type: ignore[arg-type]
                              "00" * 32, ["127.0.0.1:1"], lambda actor: None)
    restarts.poll()              # probes sent (no node watch: Ray says the actor died)
    restarts.poll()
    assert started == restarted
    assert coordinator.placed == len(restarted)
