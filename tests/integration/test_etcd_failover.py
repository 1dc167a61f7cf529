"""The etcd client fails over between the members of a real 3-member etcd cluster: the
member it is connected to is killed, and its calls, its lease and its watches carry on at
another member (before, it stuck to the first endpoint). The call in flight on the killed
member is made again on the next one, a transaction whose first try landed included."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.launcher.services.etcd_server import (etcd_healthy, find_etcd_binary,
                                                   free_loopback_ports)
from phalanx.runtime.base import MemberRecord, WatchEvent
from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.membership.etcd import EtcdMembership

MEMBERS = 3


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Three etcd members on loopback, joined with ``--initial-cluster``: endpoint → process."""
    ports = free_loopback_ports(2 * MEMBERS)
    clients = [f"127.0.0.1:{p}" for p in ports[:MEMBERS]]
    peers = [f"http://127.0.0.1:{p}" for p in ports[MEMBERS:]]
    initial = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for i, (client, peer) in enumerate(zip(clients, peers)):
            log = open(tmp_path / f"m{i}.log", "wb")  # noqa: SIM115 - etcd holds it
            procs[client] = subprocess.Popen(
                [find_etcd_binary(), f"--name=m{i}", f"--data-dir={tmp_path / f'm{i}'}",
                 f"--listen-client-urls=http://{client}", f"--advertise-client-urls=http://{client}",
                 f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                 f"--initial-cluster={initial}", "--initial-cluster-state=new",
                 "--heartbeat-interval=50", "--election-timeout=500"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            log.close()
        deadline = time.monotonic() + 30
        while not all(etcd_healthy(c) for c in clients):
            assert time.monotonic() < deadline, "3-member etcd cluster not healthy in 30 s"
            time.sleep(0.1)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_client_fails_over_when_its_member_dies(
        etcd_cluster: dict[str, subprocess.Popen[bytes]]) -> None:
    endpoints = list(etcd_cluster)
    membership = EtcdMembership(endpoints, "/phalanx/failover/", timeout_s=2.0).connect()
    seen: list[WatchEvent] = []
    try:
        first = membership.endpoint
        assert first == endpoints[0]
        membership.join(MemberRecord(worker_id="w0", rank=0, node="n0", endpoint="e", pid=1),
                        ttl_s=3)
        membership.watch_prefix("watched/", seen.append)
        membership.put("watched/a", b"1")

        etcd_cluster[first].send_signal(signal.SIGKILL)
        etcd_cluster[first].wait(timeout=10)

        # the call that finds its member dead fails over and is made again on the next one
        membership.put("watched/b", b"2")
        assert membership.endpoint != first, "the client still uses the killed member"
        assert membership.get("watched/b").value == b"2"  # type: ignore[union-attr]
        time.sleep(4.0)     # longer than the lease TTL: only refreshes elsewhere keep it
        assert not membership.lease_lost
        assert "w0" in membership.members()
        deadline = time.monotonic() + 10
        while [e.key for e in seen] != ["watched/a", "watched/b"]:
            assert time.monotonic() < deadline, f"watch saw {seen}"
            time.sleep(0.05)
        membership.put("watched/c", b"3")
        time.sleep(0.5)
        assert [e.key for e in seen] == ["watched/a", "watched/b", "watched/c"], \
            "a watch event was lost or repeated across the failover"
    finally:
        membership.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_transaction_in_flight_when_its_member_dies_is_settled_on_the_next(
        etcd_cluster: dict[str, subprocess.Popen[bytes]]) -> None:
    """A compare-and-swap whose member dies: made again on the next member. When the first
    try had landed (here: written through another client, as a write whose answer the dead
    member never sent), the repeat's compare fails and the read-back finds its value:
    True. Another value there means another writer won: False."""
    endpoints = list(etcd_cluster)
    ours = EtcdMembership(endpoints, "/phalanx/cas/", timeout_s=2.0).connect()
    other = EtcdMembership(endpoints[1:], "/phalanx/cas/", timeout_s=2.0).connect()
    try:
        ours.put("generation", b"3")
        start = ours.get("generation")
        assert start is not None and ours.endpoint == endpoints[0]
        etcd_cluster[endpoints[0]].send_signal(signal.SIGKILL)
        etcd_cluster[endpoints[0]].wait(timeout=10)
        assert other.compare_and_swap("generation", start.mod_revision, b"4")   # "landed"
        assert ours.compare_and_swap("generation", start.mod_revision, b"4")
        assert ours.endpoint != endpoints[0]
        moved = ours.get("generation")
        assert moved is not None and moved.value == b"4"
        assert not ours.compare_and_swap("generation", start.mod_revision, b"5")
        assert ours.put_if("generation", moved.mod_revision, {"generation": b"5", "plan/5": b"p"})
        assert other.get("plan/5").value == b"p"      # type: ignore[union-attr]
    finally:
        ours.close()
        other.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_call_whose_connection_another_thread_closes_raises_membership_unavailable(
        etcd_cluster: dict[str, subprocess.Popen[bytes]]) -> None:
    """grpc raises a plain ValueError for a call on a channel closed under it (seen: a
    rank polling a drill gate while its membership was closed): the caller gets the typed
    MembershipUnavailable it handles, not an error that ends the worker. A ValueError with
    the connection still open is a bug, and stays one."""
    membership = EtcdMembership([next(iter(etcd_cluster))], "/closed-under/").connect()
    client = membership._conn()                 # what _call holds when the close comes
    with pytest.raises(MembershipUnavailable, match="closed under the call"):
        with membership._translate("get", "k"):
            membership.close()
            client.get("/closed-under/k")
    with pytest.raises(MembershipUnavailable, match="is closed"):
        membership.get("k")
    other = EtcdMembership([next(iter(etcd_cluster))], "/closed-under/").connect()
    try:
        with pytest.raises(ValueError, match="a bug"):
            with other._translate("get", "k"):
                raise ValueError("a bug")
    finally:
        other.close()
