"""phalanx on real hosts: three network namespaces on one bridge, a Ray head and raylets
started with ``ray start``, a 3-member etcd cluster, and the launcher on host 0 with
``ray.address`` and ``etcd.endpoints``. Each drill must end bit-identical to the fault-free
run of the same config (``phalanx drill run --verify``).

Tests share one cluster (module fixture) and run in file order: the etcd member test
restarts its member, so the cluster is whole again afterwards.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.netns import NetnsCluster, namespace_pids, namespaces, unavailable_reason
from tests.cluster.services import ClusterServices, runs_dir

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
                    "run_dir": str(runs_dir(mh.workdir))}})
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
    """Until ``proc`` exits (calling ``watch()`` meanwhile); fails with the log tail. A
    failure on the way stops the launcher (SIGTERM: it tears its job down), so the next
    test finds no job of this name still led."""
    deadline = time.monotonic() + DRILL_TIMEOUT_S
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"drill did not end in {DRILL_TIMEOUT_S} s:\n"
                            f"{log.read_text()[-4000:]}")
            if watch is not None:
                watch()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, f"drill failed ({proc.returncode}):\n{log.read_text()[-6000:]}"


def _newest_report(mh: ClusterServices) -> dict[str, Any]:
    reports = sorted((mh.workdir / "runs").glob("*/drill-report.json"),
                     key=lambda p: p.stat().st_mtime)
    assert reports, "no drill report written"
    return dict(json.loads(reports[-1].read_text()))


def _kill_to_first_step_s(report: dict[str, Any]) -> float:
    fault = report["faults"][0]
    return float(fault["detection_s"]) + float(fault["recovery"]["recovery_s"])


def _reference(mh: ClusterServices) -> dict[str, str]:
    """The fault-free final hashes the first drill of the module cached (rank -> hash)."""
    references = list((mh.workdir / "runs" / "references").glob("*.json"))
    assert len(references) == 1, "the drills above cache the fault-free reference"
    return dict(json.loads(references[0].read_text())["hashes"])


def _launch(mh: ClusterServices, log: Path, *sets: str) -> subprocess.Popen[bytes]:
    """``phalanx launch`` of the module's job on the launcher host, ``--set`` each of
    ``sets``."""
    overrides = [arg for key in sets for arg in ("--set", key)]
    return mh.cluster.spawn(mh.launcher_host,
                            [_phalanx(), "launch", str(_job_config(mh)), *overrides],
                            log=log, env=mh.env, cwd=REPO)


def _final_hashes(log: Path) -> dict[str, str]:
    return dict(re.findall(r"^rank (\d+) final parameter hash ([0-9a-f]{64})$",
                           log.read_text(), re.M))


def _newest_run(mh: ClusterServices) -> Path:
    return max((mh.workdir / "runs").glob(f"{JOB}-*"), key=lambda p: p.stat().st_mtime)


def _events(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def _worker_pid(mh: ClusterServices, rank: int) -> int:
    """The pid of rank ``rank``'s worker, from its member record in its keeper's report
    (its log is on its own host until the run ends)."""
    pids = [record["pid"] for value in _etcd_get(mh, "keepers/")
            for record in (json.loads(value).get("members") or {}).values()
            if record["rank"] == rank]
    assert len(pids) == 1, pids
    return int(pids[0])


def _steps_per_s(events: list[dict[str, Any]], since: float = 0.0) -> float:
    """The job's step rate from its progress events at or after ``since`` (epoch s)."""
    points = [(e["time"], e["max_step"]) for e in _named(events, "progress")
              if e["time"] >= since and e["max_step"] >= 0]
    assert len(points) >= 2, f"too few progress events after {since}: {points}"
    (t0, s0), (t1, s1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0)


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
    # no shared filesystem: the keepers' disk tier stayed on their hosts, and the ranks'
    # logs (the killed worker's, its survivor's and the promoted spare's) were brought to
    # the launcher's run directory through the keepers
    run = Path(report["run"]["run_dir"])
    assert _named(_events(run), "tier_persisted") and not (run / "checkpoints").exists()
    logs = {p.name: p.read_text() for p in (run / "logs").iterdir()}
    assert {"rank_0_w0-g0.log", "rank_1_w1-g0.log"} <= set(logs), sorted(logs)
    assert any(name.startswith("rank_1_spare") for name in logs), sorted(logs)
    assert all("event=worker_run" in text for text in logs.values()), logs
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
def test_a_slow_lossy_link_slows_training_and_recovers_nothing(
        multihost: ClusterServices) -> None:
    """Host 2's cable (phalanx node 1: rank 1, its keeper, etcd member 2) turns slow and
    lossy at step 10 for the rest of the run (``NetnsCluster.degrade``: netem, or a token
    bucket where the kernel lacks netem). The gloo all-reduce and the replication pushes
    crossing it slow every step; no signal may take that for a fault."""
    if shutil.which("tc") is None:
        pytest.skip("the `tc` command (iproute2) is missing")
    mh = multihost
    reference = _reference(mh)
    log = mh.workdir / "slow_link.log"
    victim = mh.node_hosts[1]
    degraded: list[tuple[float, str]] = []

    def watch() -> None:
        if not degraded and _min_step(mh) >= 10:
            degraded.append((time.time(), mh.cluster.degrade(victim)))

    try:
        _wait(_launch(mh, log), log, watch)
        dropped = mh.cluster.dropped(victim)
    finally:
        mh.cluster.restore(victim)
    assert degraded, "the job never reached step 10"
    assert _final_hashes(log) == reference
    events = _events(_newest_run(mh))
    assert not _named(events, "fault") and not _named(events, "recovered"), \
        [e for e in events if e["event"] in ("fault", "recovered", "alert")]
    clean = [_events(run) for run in (mh.workdir / "runs").glob(f"{JOB}-*")
             if (run / "events.jsonl").is_file()]
    clean_rates = [_steps_per_s(ev) for ev in clean
                   if _named(ev, "finished") and not _named(ev, "fault")
                   and ev is not events and _named(ev, "progress")]
    assert clean_rates, "no fault-free run of this job to compare with"
    slowed = _steps_per_s(events, since=degraded[0][0])
    away = log.read_text().count("event=keeper_away")    # a lease that lapsed on the link
    print(f"multihost slow link ({degraded[0][1]}): {slowed:.1f} steps/s against "
          f"{max(clean_rates):.1f} on a clean link; {dropped} packets dropped; node keeper "
          f"leases lapsed and excused: {away}")
    assert slowed < 0.8 * max(clean_rates), (slowed, clean_rates)


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_two_etcd_members_lost_training_goes_on_and_recovery_waits_for_quorum(
        multihost: ClusterServices) -> None:
    """etcd members 1 and 2 of 3 are killed at step 15: no quorum. Training goes on (a
    step needs no etcd); 2 s later rank 1's worker is SIGKILLed: the launcher sees the
    fault, but cannot fence a new generation without quorum, so the recovery waits; the
    members come back 6 s later and the job recovers and ends bit-identical."""
    mh = multihost
    reference = _reference(mh)
    log = mh.workdir / "etcd_quorum.log"
    marks: dict[str, float] = {}
    step_at_loss: list[int] = []
    victim: list[int] = []          # rank 1's worker pid

    def watch() -> None:
        if "quorum_lost" not in marks:
            step = _min_step(mh)
            if step >= 15:
                step_at_loss.append(step)
                victim.append(_worker_pid(mh, 1))    # etcd answers no reads without quorum
                mh.kill_etcd(1)
                mh.kill_etcd(2)
                marks["quorum_lost"] = time.time()
        elif "worker_killed" not in marks and time.time() > marks["quorum_lost"] + 2:
            os.kill(victim[0], signal.SIGKILL)
            marks["worker_killed"] = time.time()
        elif "quorum_back" not in marks and "worker_killed" in marks \
                and time.time() > marks["worker_killed"] + 6:
            marks["quorum_back"] = time.time()
            mh.restart_etcd(1, 2)

    try:
        # 0.2 s per step: the job still trains when the members come back (the sleep is
        # outside the computation: the fault-free hashes of 0.05 s steps apply)
        _wait(_launch(mh, log, "job.args.sleep_per_step_s=0.2"), log, watch)
    finally:
        dead = [member for member in (1, 2) if mh.etcd_procs[member].poll() is not None]
        if dead:
            mh.restart_etcd(*dead)
    assert "quorum_back" in marks, f"the job ended before the quorum came back: {marks}"
    assert _final_hashes(log) == reference
    run = _newest_run(mh)
    events = _events(run)
    faults, recovered = _named(events, "fault"), _named(events, "recovered")
    assert [f["ranks"] for f in faults] == [[1]], faults
    (record,) = recovered
    # the recovery could not fence before the quorum was back, and did right after
    assert record["first_step_at"] > marks["quorum_back"], (record, marks)
    assert record["first_step_at"] < marks["quorum_back"] + 20, (record, marks)
    # training went on without quorum: the step the job resumed at (the survivors' own,
    # healed) is past the step at which the quorum was lost by about the 2 s in between
    # (0.2 s steps). The plan's step is only the commit point, the floor: the survivors'
    # last commit written before etcd went away, or older when the killed rank's newest
    # snapshot is a step behind theirs
    print(f"multihost etcd quorum: lost at step {step_at_loss[0]}, worker killed 2 s later, "
          f"resumed at step {record['restore_step']} ({record['lost_steps']} lost), first "
          f"step {record['first_step_at'] - marks['quorum_back']:.2f} s after the quorum "
          "came back")
    assert record["restore_step"] >= step_at_loss[0] + 5, (record, step_at_loss)
    assert record["lost_steps"] <= 1, record


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_a_host_cut_off_for_a_while_is_fenced_and_never_rejoins(
        multihost: ClusterServices) -> None:
    """Host 2's cable is cut at step 20 and plugged back 10 s later, its processes alive
    throughout (a partition, not a crash). The launcher finds the node silent, replaces
    its rank from the replica on node 0, and trains on; once the cable is back, the
    cut-off worker must not rejoin the job (its generation is fenced) and ends once the
    launcher's kill reaches it. Ray's health check (10 s per probe) outlasts the cut, so
    the host's raylet normally lives on; were it declared dead, it is started again, as an
    operator would, for the test below."""
    mh = multihost
    reference = _reference(mh)
    log = mh.workdir / "partition.log"
    victim = mh.node_hosts[1]
    marks: dict[str, float] = {}

    def watch() -> None:
        if "cut" not in marks and _min_step(mh) >= 20:
            mh.cluster.link(victim, up=False)
            marks["cut"] = time.time()
        elif "cut" in marks and "plugged" not in marks and time.time() > marks["cut"] + 10:
            mh.cluster.link(victim, up=True)
            marks["plugged"] = time.time()

    try:
        # 0.25 s per step: the job still trains when the cable is back
        _wait(_launch(mh, log, "recovery.group_timeout_s=10",
                      "job.args.sleep_per_step_s=0.25"), log, watch)
    finally:
        mh.cluster.link(victim, up=True)
    assert "plugged" in marks, f"the job ended before the cable was back: {marks}"
    assert _final_hashes(log) == reference
    run = _newest_run(mh)
    events = _events(run)
    lost = [e for e in _named(events, "fault") if e["kind"] == "node_died"]
    assert lost and lost[0]["node"] == "node1" and lost[0]["ranks"] == [1], lost
    assert _named(events, "recovered")
    finished = _named(events, "finished")[0]["time"]
    assert finished > marks["plugged"], "the job must still train once the cable is back"
    # the cut-off node is lost to the job: its files stay on its host (no shared folder)
    assert not (run / "logs" / "rank_1_w1-g0.log").exists()
    old_log = mh.read_host_file(1, run / "logs" / "rank_1_w1-g0.log")
    assert "event=member_rejoined" not in old_log, old_log[-3000:]
    old = int(re.findall(r"event=worker_run rank=1 pid=(\d+)", old_log)[0])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{old}").exists():
        assert time.monotonic() < deadline, f"the cut-off worker {old} still runs"
        time.sleep(0.2)
    print(f"multihost partition: cut -> fault {lost[0]['time'] - marks['cut']:.2f} s; "
          f"the cut-off worker gone {time.time() - marks['plugged']:.1f} s after the plug; "
          f"raylet restarted: {mh.ensure_raylet(1)}")


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_host_power_loss_mid_run_ends_bit_identical(multihost: ClusterServices) -> None:
    """Host 2 (phalanx node 1, rank 1, etcd member 2) loses power at step 30: its cable is
    cut and every process in it killed at once. No socket to it closes, so the node watch
    hears nothing; its keeper's etcd lease (the node's one lease) lapses and the launcher
    finds neither its keeper nor its raylet answering: a lost node. Last in the file: the
    host stays dead."""
    mh = multihost
    reference = _reference(mh)
    log = mh.workdir / "power_loss.log"
    lost: list[float] = []
    victim = mh.node_hosts[1]

    def watch() -> None:
        if not lost and _min_step(mh) >= 30:
            killed = mh.cluster.power_off(victim)
            lost.append(time.time())
            assert killed > 0, f"no process ran in {victim.netns}"

    # a short recovery deadline: a plan that kept the dead node would fail in 10 s, not 30
    proc = _launch(mh, log, "recovery.group_timeout_s=10")
    try:
        _wait(proc, log, watch)
    finally:
        for shm in Path("/dev/shm").glob(f"phalanx-{JOB}-*"):   # a dead host's memory
            shm.unlink(missing_ok=True)
    assert lost, "the job never reached step 30"
    hashes = _final_hashes(log)
    assert hashes == reference, f"{hashes} != fault-free {reference}"
    events = _events(_newest_run(mh))
    faults, recovered = _named(events, "fault"), _named(events, "recovered")
    assert faults and recovered, "no fault detected or no recovery recorded"
    print(f"multihost power loss: fault {faults[0]}\nrecovered {recovered[0]}\n"
          f"power off -> fault {faults[0]['time'] - lost[0]:.3f} s, -> first step "
          f"{recovered[0]['first_step_at'] - lost[0]:.3f} s")
