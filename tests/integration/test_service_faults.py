"""Service faults against real services: the embedded etcd SIGKILLed and started again on its
port and data (leases, keys and watches come back; a lease etcd lost is granted again), the
drill mechanisms, and two demo jobs that must end bit-identical to a fault-free run: one
whose etcd dies for 2 s at step 20, one whose node-0 keeper is SIGKILLed at step 20, both
faults driven from this test process (no test hook in phalanx)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from configs.errors import MembershipUnavailable
from launcher.etcd_server import EmbeddedEtcd, etcd_healthy
from launcher.faults import FaultSpec, catalogue
from runtime.base import MemberRecord, WatchEvent
from runtime.commit import KeeperReport
from runtime.keeper_reporter import KeeperReporter, keeper_member
from runtime.membership_etcd import EtcdMembership, job_prefix
from tests.integration.launching import ROOT, LaunchResult, launch, phalanx_command

pytestmark = pytest.mark.integration
JOB = ("job.args.steps=200", "job.args.sleep_per_step_s=0.05")
FAULT_AT_STEP = 20
PID_RE = re.compile(r"event=worker_run rank=(\d+) pid=(\d+)")


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

@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> LaunchResult:
    result = launch("configs/demo.yaml", *JOB, run_root=tmp_path_factory.mktemp("free"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class RunningJob:
    """``phalanx launch`` in the background, with etcd read from this test process."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = run_root
        self.out, self.err = run_root / "stdout.txt", run_root / "stderr.txt"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                phalanx_command("configs/demo.yaml", *JOB, run_root=run_root), cwd=ROOT,
                stdout=out, stderr=err, text=True, env={**os.environ, "COLUMNS": "200"})
        found = eventually(lambda: next(run_root.glob("*/job.json"), None), 120, 0.2)
        assert found is not None, self.err.read_text()[-3000:]
        self.run_dir = found.parent
        self.info = json.loads(found.read_text())
        self.etcd = EtcdMembership(self.info["etcd_endpoints"],
                                   job_prefix(self.info["etcd_prefix"], self.info["job"]),
                                   timeout_s=2.0)

    def wait_step(self, step: int, within_s: float = 180) -> None:
        def reached() -> bool:
            steps = [m.step for m in self.etcd.members().values() if m.rank >= 0]
            return len(steps) == 4 and min(steps) >= step
        assert eventually(reached, within_s, 0.05), self.err.read_text()[-3000:]

    def finish(self, timeout_s: float = 300) -> LaunchResult:
        self.proc.wait(timeout=timeout_s)
        self.etcd.close()
        return LaunchResult(self.proc.returncode, self.out.read_text(), self.err.read_text())

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "events.jsonl").open()]

    def worker_pids(self) -> dict[str, set[int]]:
        return {log.stem: {int(pid) for _, pid in PID_RE.findall(log.read_text())}
                for log in (self.run_dir / "logs").iterdir()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def etcd_process(endpoint: str) -> tuple[int, list[str]]:
    """pid and argv of the etcd serving ``endpoint`` (the launcher's embedded one)."""
    marker = f"--listen-client-urls=http://{endpoint}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv:
                return int(entry.name), [a.decode() for a in argv if a]
    raise AssertionError(f"no etcd process serves {endpoint}")


def assert_no_recovery(job: RunningJob, result: LaunchResult, fault_free: LaunchResult) -> list:
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.hashes == fault_free.hashes, "final parameters differ from the fault-free run"
    events = job.events()
    kinds = [e["event"] for e in events]
    assert "fault" not in kinds and "recovered" not in kinds, kinds
    pids = job.worker_pids()
    assert sorted(pids) == [f"rank_{r}_w{r}-g0" for r in range(4)], sorted(pids)
    assert all(len(found) == 1 for found in pids.values()), pids   # nobody restarted
    return events


@pytest.mark.timeout(500)
def test_a_job_rides_out_its_etcd_sigkilled_for_two_seconds(
        tmp_path: Path, fault_free: LaunchResult) -> None:
    job, respawned = RunningJob(tmp_path), None
    try:
        job.wait_step(FAULT_AT_STEP)
        endpoint = job.info["etcd_endpoints"][0]
        pid, argv = etcd_process(endpoint)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(2.0)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        respawned = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        assert eventually(lambda: etcd_healthy(endpoint), 15), "etcd did not come back"
        print(f"etcd down {time.monotonic() - killed:.2f} s")
        result = job.finish()
    finally:
        job.kill()
        if respawned is not None:
            respawned.kill()
            respawned.wait()
    events = assert_no_recovery(job, result, fault_free)
    kinds = [e["event"] for e in events]
    assert "etcd_unreachable" in kinds and "etcd_reachable" in kinds, kinds
    back = next(e for e in events if e["event"] == "etcd_reachable")
    print(f"launcher saw etcd down {back['down_s']} s")


@pytest.mark.timeout(500)
def test_a_killed_keeper_is_replaced_and_its_workers_move_to_the_new_one(
        tmp_path: Path, fault_free: LaunchResult) -> None:
    job = RunningJob(tmp_path)
    try:
        job.wait_step(FAULT_AT_STEP)
        keeper = job.etcd.members()["keeper.node0"]
        os.kill(keeper.pid, signal.SIGKILL)
        killed = time.time()
        result = job.finish()
    finally:
        job.kill()
    events = assert_no_recovery(job, result, fault_free)
    lost = [e for e in events if e["event"] == "keeper_lost"]
    restarted = [e for e in events if e["event"] == "keeper_restarted"]
    assert [e["node"] for e in lost] == ["node0"] and [e["node"] for e in restarted] == ["node0"]
    assert restarted[0]["port"] != int(keeper.endpoint.rsplit(":", 1)[1])
    placements = [e for e in events if e["event"] == "placement" and e["time"] > killed]
    assert placements, "replica placement was not sent again"
    moved = [name for name in job.worker_pids()
             if "event=keeper_reconnected" in (job.run_dir / "logs" / f"{name}.log").read_text()]
    assert sorted(moved) == ["rank_0_w0-g0", "rank_2_w2-g0"], moved
    print(f"kill -> keeper restarted {restarted[0]['time'] - killed:.2f} s "
          f"(noticed to serving {restarted[0]['seconds']} s, cause: {restarted[0]['cause']})")
