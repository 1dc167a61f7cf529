"""EmbeddedEtcd: starts fast, answers, cleans up, survives restart, dies with its parent."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phalanx.configs.errors import ServiceStartError
from phalanx.launcher.services import etcd_server
from phalanx.launcher.services.etcd_server import EmbeddedEtcd, etcd_healthy
from phalanx.runtime.base import MemberRecord, WatchEvent
from phalanx.runtime.membership.etcd import EtcdMembership

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def pid_alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie may wait for a non-reaping init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def wait_dead(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.timeout(20)
def test_starts_fast_answers_and_close_cleans_up(tmp_path: Path) -> None:
    server = EmbeddedEtcd(tmp_path / "data")
    began = time.monotonic()
    server.start()
    try:
        assert time.monotonic() - began < 5.0
        assert server.endpoint == f"127.0.0.1:{server.client_port}"
        assert etcd_healthy(server.endpoint)
        pid = server.pid
        assert pid is not None and pid_alive(pid)
        member = EtcdMembership([server.endpoint], "/phalanx/t/")
        member.put("k", b"v")
        assert member.get("k") is not None
        member.close()
    finally:
        server.close()

    assert wait_dead(pid, within_s=1.0)
    assert not (tmp_path / "data").exists()
    server.close()  # second close is a no-op


@pytest.mark.timeout(30)
def test_restart_keeps_data_and_ports_even_from_a_short_lived_thread(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "data") as server:
        before = EtcdMembership([server.endpoint], "/phalanx/t/")
        before.put("kept", b"across restart")
        before.close()
        port, old_pid = server.client_port, server.pid

        drill = threading.Thread(target=server.restart)  # exits right after restart()
        drill.start()
        drill.join(timeout=15)

        assert server.client_port == port and server.pid != old_pid
        time.sleep(0.2)  # a parent-death signal would have landed by now
        assert server.pid is not None and pid_alive(server.pid)
        after = EtcdMembership([server.endpoint], "/phalanx/t/")
        kept = after.get("kept")
        after.close()
        assert kept is not None and kept.value == b"across restart"


@pytest.mark.timeout(30)
def test_watch_and_lease_survive_a_restart(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "data") as server:
        member = EtcdMembership([server.endpoint], "/phalanx/t/", timeout_s=2.0)
        seen: list[WatchEvent] = []
        member.watch_prefix("plan/", seen.append)
        member.join(MemberRecord("w1", rank=0, node="n0"), ttl_s=5)
        member.put("plan/1", b"before")

        server.restart()
        writer = EtcdMembership([server.endpoint], "/phalanx/t/", timeout_s=2.0)
        writer.put("plan/2", b"while the watcher reconnects")
        writer.put("plan/3", b"after")
        writer.close()

        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [e.key for e in seen] == ["plan/1", "plan/2", "plan/3"]
        member.update(MemberRecord("w1", rank=0, node="n0", step=5))  # lease kept
        assert member.members()["w1"].step == 5
        member.close()


@pytest.mark.timeout(20)
def test_start_failure_raises_service_start_error_with_log_tail(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("a file where the data dir should be")
    server = EmbeddedEtcd(not_a_dir, startup_timeout_s=5.0, remove_data=False)

    with pytest.raises(ServiceStartError, match="etcd"):
        server.start()
    server.close()
    assert not_a_dir.is_file()


@pytest.mark.timeout(20)
def test_port_race_is_retried_on_other_ports(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real = etcd_server.free_loopback_ports
    calls: list[list[int]] = []

    def first_one_taken(count: int) -> list[int]:
        ports = real(count)
        if not calls:
            ports[0] = taken.getsockname()[1]
        calls.append(ports)
        return ports

    monkeypatch.setattr(etcd_server, "free_loopback_ports", first_one_taken)
    try:
        with EmbeddedEtcd(tmp_path / "data") as server:
            assert len(calls) == 2 and server.client_port == calls[1][0]
            assert etcd_healthy(server.endpoint)
    finally:
        taken.close()


CHILD = """
import sys, time
from pathlib import Path
from phalanx.launcher.services.etcd_server import EmbeddedEtcd
server = EmbeddedEtcd(Path(sys.argv[1])).start()
print(server.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(30)
def test_sigkilled_parent_leaves_no_orphan(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "data")],
                              stdout=subprocess.PIPE, cwd=REPO)
    etcd_pid = 0
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 15)
        assert ready, "the child did not report an etcd pid within 15 s"
        etcd_pid = int(parent.stdout.readline())
        assert pid_alive(etcd_pid)

        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=5)

        assert wait_dead(etcd_pid, within_s=3.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=5)
        if etcd_pid and pid_alive(etcd_pid):
            os.kill(etcd_pid, signal.SIGKILL)
