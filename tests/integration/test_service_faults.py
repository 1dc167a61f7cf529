"""Service faults against real services: the embedded etcd SIGKILLed and started again on its
port and data (leases, keys and watches come back; a lease etcd lost is granted again) and
the etcd_restart and kill_keeper drill mechanisms. Whole jobs riding out both faults are
tests/integration/test_drills.py's etcd_restart and kill_keeper scenarios."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from phalanx.configs.errors import MembershipUnavailable
from phalanx.launcher.services.etcd_server import EmbeddedEtcd, etcd_healthy
from phalanx.launcher.drills.catalogue import FaultSpec, catalogue
from phalanx.runtime.base import MemberRecord, WatchEvent
from phalanx.runtime.commit import KeeperReport
from phalanx.runtime.keeper.reporter import KeeperReporter, keeper_member
from phalanx.runtime.membership.etcd import EtcdMembership, job_prefix

pytestmark = pytest.mark.integration


def eventually(predicate: Callable[[], Any], within_s: float, every_s: float = 0.02) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            found = predicate()
        except MembershipUnavailable:
            found = None
        if found:
            return found
        time.sleep(every_s)
    return predicate()


def etcdctl(endpoint: str, *args: str) -> None:
    binary = Path(sys.executable).parent / "etcdctl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
    subprocess.run([str(binary), f"--endpoints={endpoint}", *args], check=True,
                   capture_output=True, timeout=10, env=env)


# -- etcd: the building blocks -------------------------------------------------------------

@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(tmp_path / "data").start()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_sigkilled_etcd_started_again_keeps_port_keys_leases_and_watches(
        etcd: EmbeddedEtcd) -> None:
    member = EtcdMembership([etcd.endpoint], "/phalanx/t/", timeout_s=2.0)
    seen: list[WatchEvent] = []
    member.watch_prefix("plan/", seen.append)
    member.join(MemberRecord("w1", rank=0, node="node0", step=1), ttl_s=2)
    member.put("plan/1", b"before")
    lease, port = member.lease_id, etcd.client_port

    pid = etcd.stop("kill")
    assert pid is not None and etcd.pid is None and not etcd_healthy(etcd.endpoint)
    with pytest.raises(MembershipUnavailable):
        member.update(MemberRecord("w1", rank=0, node="node0", step=2))
    time.sleep(3.0)                        # longer than the lease's TTL
    assert member.lease_lost == "" and member.lease_silent_s > 2.0
    etcd.start()
    assert etcd.client_port == port and etcd.pid not in (None, pid)

    assert eventually(lambda: member.lease_silent_s < 1.5, 5.0)   # refreshed again
    member.update(MemberRecord("w1", rank=0, node="node0", step=3))
    assert member.lease_id == lease and member.members()["w1"].step == 3
    member.put("plan/2", b"after")
    assert eventually(lambda: [e.key for e in seen] == ["plan/1", "plan/2"], 5.0)
    member.close()


@pytest.mark.timeout(60)
def test_a_lease_etcd_lost_is_granted_again_and_the_report_put_back(
        etcd: EmbeddedEtcd) -> None:
    prefix = job_prefix("/phalanx", "svc")
    keeper, observer = (EtcdMembership([etcd.endpoint], prefix, timeout_s=2.0)
                        for _ in range(2))
    report = KeeperReport("node0", ("127.0.0.1", 4242))
    reporter = KeeperReporter(keeper, "node0", lambda: report, heartbeat_s=0.2, ttl_s=2,
                              member=keeper_member("node0", ("127.0.0.1", 4242), os.getpid()))
    reporter.start()
    try:
        first = keeper.lease_id
        assert observer.get("keepers/node0") is not None
        etcdctl(etcd.endpoint, "lease", "revoke", f"{first:x}")   # etcd lost the lease
        assert observer.get("keepers/node0") is None
        assert eventually(lambda: observer.get("keepers/node0"), 5.0)
        assert keeper.lease_id not in (0, first)
        assert "keeper.node0" in observer.members()
    finally:
        reporter.close()
        keeper.close()
        observer.close()


class FakeEnv:
    """The part of ``FaultEnv`` the service mechanisms use."""

    def __init__(self, etcd: EmbeddedEtcd | None = None, keeper_pid: int | None = None) -> None:
        self.etcd, self.pid = etcd, keeper_pid
        self.deferred: list[tuple[float, Callable[[], None]]] = []
        self.events: list[tuple[str, dict]] = []

    def service(self, name: str) -> Any:
        return self.etcd if name == "etcd" else None

    def keeper_pid(self, node: int) -> int | None:
        return self.pid

    def config(self) -> Any:
        class Job:
            nodes = 2
        return type("Cfg", (), {"job": Job})()

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self.deferred.append((seconds, action))

    def emit(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


@pytest.mark.timeout(60)
def test_the_etcd_restart_mechanism_stops_and_starts_the_embedded_etcd(
        etcd: EmbeddedEtcd) -> None:
    mechanism = catalogue()["etcd_restart"]
    assert (mechanism.family, mechanism.target, mechanism.roles, mechanism.recovers,
            mechanism.chaos) == ("communication", "role", ("etcd",), "none", True)
    member = EtcdMembership([etcd.endpoint], "/phalanx/t/", timeout_s=2.0)
    member.put("kept", b"1")
    env, port = FakeEnv(etcd), etcd.client_port
    spec = FaultSpec("etcd_restart", role="etcd", at_step=1,
                     params={"signal": "kill", "down_s": 0.5})
    details = mechanism.fire(spec, env)  # type: ignore[arg-type]
    assert details["signal"] == "kill" and not etcd_healthy(etcd.endpoint)
    assert [d for d, _ in env.deferred] == [0.5] and [e for e, _ in env.events] == ["etcd_down"]
    env.deferred[0][1]()                   # what the launcher runs down_s later
    assert etcd.client_port == port and etcd_healthy(etcd.endpoint)
    assert [e for e, _ in env.events] == ["etcd_down", "etcd_up"]
    assert eventually(lambda: member.get("kept"), 5.0).value == b"1"
    member.close()
    with pytest.raises(Exception, match="embedded etcd"):
        mechanism.fire(spec, FakeEnv(None))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_the_kill_keeper_mechanism_sigkills_the_keeper_process() -> None:
    mechanism = catalogue()["kill_keeper"]
    assert (mechanism.family, mechanism.target, mechanism.recovers) == \
        ("availability", "node", "none")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    details = mechanism.fire(FaultSpec("kill_keeper", node=1, at_step=1),
                             FakeEnv(keeper_pid=victim.pid))  # type: ignore[arg-type]
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert details == {"node": "node1", "pid": victim.pid, "signal": "SIGKILL",
                       "delivered": True}


# -- whole jobs ----------------------------------------------------------------------------
