"""phalanx on real hosts: three network namespaces on one bridge, a Ray head and raylets
started with ``ray start``, a 3-member etcd cluster, and the launcher on host 0 with
``ray.address`` and ``etcd.endpoints``. Each drill must end bit-identical to the fault-free
run of the same config (``phalanx drill run --verify``).

Tests share one cluster (module fixture) and run in file order: the etcd member test
restarts its member, so the cluster is whole again afterwards.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.netns import NetnsCluster, namespace_pids, namespaces, unavailable_reason
from tests.cluster.services import ClusterServices

pytestmark = pytest.mark.multihost

REPO = Path(__file__).resolve().parents[2]
JOB = "mh"
DRILL_TIMEOUT_S = 240


def _phalanx() -> str:
    return str(Path(sys.executable).parent / "phalanx")


def _job_config(mh: ClusterServices) -> Path:
    """configs/demo.yaml as world 2 on 2 nodes (hosts 1 and 2) of this cluster."""
    dest = mh.workdir / "job.yaml"
    if not dest.exists():
        mh.write_config(REPO / "configs" / "demo.yaml", dest, {
            "job": {"name": JOB, "world_size": 2, "nodes": 2,
                    "run_dir": str(mh.workdir / "runs")}})
    return dest


def _start_drill(mh: ClusterServices, scenario: str, log: Path) -> subprocess.Popen[bytes]:
    """``phalanx drill run <scenario> --verify`` on the launcher host."""
    return mh.cluster.spawn(mh.launcher_host,
                            [_phalanx(), "drill", "run", str(REPO / scenario), "--config",
                             str(_job_config(mh)), "--verify"],
                            log=log, env=mh.env, cwd=REPO)


def _etcd_get(mh: ClusterServices, prefix: str) -> list[str]:
    """Values under ``/phalanx/<job>/<prefix>``, read with etcdctl on the launcher host."""
    proc = subprocess.run(
        ["ip", "netns", "exec", mh.launcher_host.netns,
         str(Path(sys.executable).parent / "etcdctl"),
         f"--endpoints={','.join(mh.etcd_endpoints)}", "--dial-timeout=2s",
         "--command-timeout=3s", "get", "--prefix", "--print-value-only",
         f"/phalanx/{JOB}/{prefix}"], capture_output=True, text=True, timeout=10, env=mh.env)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def _min_step(mh: ClusterServices) -> int:
    """The lowest step the job's workers report in etcd (their records ride in their node
    keeper's ``keepers/<node>`` report); -1 before both report."""
    steps = [record["step"] for value in _etcd_get(mh, "keepers/")
             for record in (json.loads(value).get("members") or {}).values()]
    return min(steps) if len(steps) >= 2 else -1


def _wait(proc: subprocess.Popen[bytes], log: Path, watch: Any = None) -> None:
    """Until ``proc`` exits (calling ``watch()`` meanwhile); fails with the log tail."""
    deadline = time.monotonic() + DRILL_TIMEOUT_S
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"drill did not end in {DRILL_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
        if watch is not None:
            watch()
        time.sleep(0.2)
    assert proc.returncode == 0, f"drill failed ({proc.returncode}):\n{log.read_text()[-6000:]}"


def _newest_report(mh: ClusterServices) -> dict[str, Any]:
    reports = sorted((mh.workdir / "runs").glob("*/drill-report.json"),
                     key=lambda p: p.stat().st_mtime)
    assert reports, "no drill report written"
    return dict(json.loads(reports[-1].read_text()))


def _kill_to_first_step_s(report: dict[str, Any]) -> float:
    fault = report["faults"][0]
    return float(fault["detection_s"]) + float(fault["recovery"]["recovery_s"])


@pytest.mark.timeout(60)
def test_namespace_hosts_talk_and_are_torn_down_with_their_processes(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host cluster unavailable: {reason}")
    cluster = NetnsCluster(2, prefix="phxu", subnet="10.231.1").create()
    try:
        a, b = cluster.hosts
        server = cluster.spawn(b, [sys.executable, "-c", (
            "import socket; s = socket.create_server(('%s', 7000)); c, _ = s.accept(); "
            "c.sendall(b'from-b'); import time; time.sleep(600)") % b.address],
            log=tmp_path / "server.log")
        deadline = time.monotonic() + 10
        while True:
            probe = subprocess.run(
                ["ip", "netns", "exec", a.netns, sys.executable, "-c",
                 "import socket; print(socket.create_connection(('%s', 7000), 2).recv(16))"
                 % b.address], capture_output=True, text=True, timeout=10)
            if probe.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "from-b" in probe.stdout, probe.stderr
        assert namespace_pids(b.netns) == [server.pid]
    finally:
        cluster.destroy()
    assert not namespaces("phxu")
    assert server.wait(timeout=5) == -9        # killed by the teardown, not left running


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_kill_worker_drill_on_three_hosts_is_bit_identical(multihost: ClusterServices) -> None:
    mh = multihost
    log = mh.workdir / "kill_worker.log"
    keepers: set[str] = set()

    def watch() -> None:
        for value in _etcd_get(mh, "members/keeper."):
            keepers.add(json.loads(value)["endpoint"].rsplit(":", 1)[0])

    _wait(_start_drill(mh, "configs/drills/kill_worker.yaml", log), log, watch)
    report = _newest_report(mh)
    assert report["passed"], json.dumps(report["checks"])
    assert [r["verdict"] for r in report["final_state"]] == ["identical"] * 2
    # keepers listen on and advertise their host's own address, never loopback
    assert keepers == {h.address for h in mh.node_hosts[:2]}, keepers
    print(f"multihost kill_worker: kill -> first step "
          f"{_kill_to_first_step_s(report):.3f} s")


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_one_etcd_member_of_three_lost_while_the_job_runs_changes_nothing(
        multihost: ClusterServices) -> None:
    """Member 0 (the first endpoint: the launcher and the keepers are connected to it) is
    killed once the keepers have joined; their leases, the launcher's monitor and the
    recovery of the drill's worker kill carry on through the two members left."""
    mh = multihost
    log = mh.workdir / "etcd_member.log"
    killed: list[float] = []
    earlier: set = set()        # keeper records seen before the drilled run began

    def watch() -> None:
        # in the drilled run, not in the fault-free reference the drill may run first
        # once the drilled run's own keepers joined, not while they start: the fault-free
        # reference run's keeper keys outlive it by a lease TTL
        current = set(_etcd_get(mh, "members/keeper."))
        if "drilled run" not in log.read_text():
            earlier.update(current)
        elif not killed and current - earlier:
            mh.kill_etcd(0)
            killed.append(time.monotonic())

    try:
        _wait(_start_drill(mh, "configs/drills/kill_worker.yaml", log), log, watch)
    finally:
        if killed:
            mh.restart_etcd(0)
    assert killed, "no keeper ever joined"
    report = _newest_report(mh)
    assert report["passed"], json.dumps(report["checks"])
    assert [r["verdict"] for r in report["final_state"]] == ["identical"] * 2
    assert len(report["recoveries"]) == 1, report["recoveries"]   # only the worker kill


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_host_power_loss_mid_run_ends_bit_identical(multihost: ClusterServices) -> None:
    """Host 2 (phalanx node 1, rank 1, etcd member 2) loses power at step 30: its cable is
    cut and every process in it killed at once. No socket to it closes, so the node watch
    hears nothing; its keeper's etcd lease (the node's one lease) lapses and the launcher
    finds neither its keeper nor its raylet answering: a lost node. Last in the file: the
    host stays dead."""
    mh = multihost
    references = list((mh.workdir / "runs" / "references").glob("*.json"))
    assert len(references) == 1, "the drills above cache the fault-free reference"
    reference = json.loads(references[0].read_text())["hashes"]
    log = mh.workdir / "power_loss.log"
    lost: list[float] = []
    victim = mh.node_hosts[1]

    def watch() -> None:
        if not lost and _min_step(mh) >= 30:
            killed = mh.cluster.power_off(victim)
            lost.append(time.time())
            assert killed > 0, f"no process ran in {victim.netns}"

    # a short recovery deadline: a plan that kept the dead node would fail in 10 s, not 30
    proc = mh.cluster.spawn(mh.launcher_host, [_phalanx(), "launch", str(_job_config(mh)),
                                               "--set", "recovery.group_timeout_s=10"],
                            log=log, env=mh.env, cwd=REPO)
    try:
        _wait(proc, log, watch)
    finally:
        for shm in Path("/dev/shm").glob(f"phalanx-{JOB}-*"):   # a dead host's memory
            shm.unlink(missing_ok=True)
    assert lost, "the job never reached step 30"
    hashes = dict(re.findall(r"^rank (\d+) final parameter hash ([0-9a-f]{64})$",
                             log.read_text(), re.M))
    assert hashes == reference, f"{hashes} != fault-free {reference}"
    run = max((mh.workdir / "runs").glob(f"{JOB}-*"), key=lambda p: p.stat().st_mtime)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    faults = [e for e in events if e["event"] == "fault"]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert faults and recovered, "no fault detected or no recovery recorded"
    print(f"multihost power loss: fault {faults[0]}\nrecovered {recovered[0]}\n"
          f"power off -> fault {faults[0]['time'] - lost[0]:.3f} s, -> first step "
          f"{recovered[0]['first_step_at'] - lost[0]:.3f} s")
