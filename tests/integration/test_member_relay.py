"""A rank's member record through its node keeper (one etcd lease and heartbeat per node),
with a real keeper serving the ``member_beat`` op, its real reporter and a real etcd: the
record is published in ``keepers/<node>`` with no lease of the rank's own; while the keeper
is gone the rank holds its own lease, and once a keeper answers again the record moves back
without the rank ever vanishing from the member table."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.runtime.base import KEEPERS, MEMBERS, MemberRecord
from phalanx.runtime.keeper.members import NodeMembers
from phalanx.runtime.keeper.reporter import KeeperReporter, keeper_member, report_from_keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.membership.etcd import EtcdMembership
from phalanx.runtime.node import node_keeper
from phalanx.runtime.worker.member_relay import MemberRelay
from tests.polling import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
SECRET = b"s" * 32
TTL_S = 1.0


class NodeKeeper:
    """A keeper with its member table and its reporter, as the keeper actor runs them."""

    def __init__(self, endpoint: str, prefix: str, shm: Path) -> None:
        self.members = NodeMembers()
        self.keeper = node_keeper("node0", "job", SECRET, str(shm), members=self.members).start()
        self.etcd = EtcdMembership([endpoint], prefix, timeout_s=5.0).connect()
        self.reporter = KeeperReporter(
            self.etcd, "node0", lambda: report_from_keeper("node0", self.keeper.address, {}, {}, 0),
            heartbeat_s=0.2, ttl_s=TTL_S, member=keeper_member("node0", self.keeper.address, 1),
            members=self.members).start()

    def stop(self) -> None:
        """As a killed keeper: it stops answering, its lease is left to lapse."""
        self.reporter._stop.set()               # noqa: SLF001  (no leave: a crash)
        self.keeper.close()

    def close(self) -> None:
        self.stop()
        self.etcd.close()


@pytest.fixture
def prefix() -> str:
    return f"/phalanx-test/{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def record(step: int) -> MemberRecord:
    return MemberRecord("w0", 0, "node0", step=step, extra={"time": time.time()})


def test_the_record_is_published_by_the_keeper_and_moves_to_an_own_lease_and_back(
        etcd_endpoint: str, prefix: str, shm: Path) -> None:
    node = NodeKeeper(etcd_endpoint, prefix, shm)
    reader = EtcdMembership([etcd_endpoint], prefix, timeout_s=5.0).connect()
    rank_etcd = EtcdMembership([etcd_endpoint], prefix, timeout_s=5.0).connect()
    address = {"now": node.keeper.address}

    def open_keeper() -> KeeperClient:
        return KeeperClient(*address["now"], SECRET, "job", timeout_s=0.5)

    relay = MemberRelay(rank_etcd, "w0", open_keeper)
    seen: list[set[str]] = []
    stop = threading.Event()

    def watch_table() -> None:      # the launcher's view, polled as it polls
        while not stop.wait(0.05):
            seen.append(set(reader.members()))
    watcher = threading.Thread(target=watch_table, daemon=True)
    try:
        relay.join(record(1), TTL_S)
        assert eventually(lambda: reader.members().get("w0", record(-1)).step == 1, 2.0)
        assert relay.via_keeper and rank_etcd.lease_id == 0      # no lease of the rank's
        assert reader.get(MEMBERS + "w0") is None and reader.get(KEEPERS + "node0") is not None
        watcher.start()
        relay.update(record(2))
        assert eventually(lambda: reader.members()["w0"].step == 2, 2.0)

        node.stop()                                   # the keeper dies
        relay.touch()                                 # the next beat finds it gone
        assert not relay.via_keeper and rank_etcd.lease_id != 0
        assert reader.get(MEMBERS + "w0") is not None

        first, node = node, NodeKeeper(etcd_endpoint, prefix, shm)      # its replacement
        first.close()
        address["now"] = node.keeper.address
        assert eventually(lambda: (relay.touch(), relay.via_keeper)[1] and
                          rank_etcd.lease_id == 0, 10.0, every_s=0.02)
        assert reader.get(MEMBERS + "w0") is None          # own lease revoked
        relay.update(record(3))
        assert eventually(lambda: reader.members()["w0"].step == 3, 2.0)
        stop.set()
        watcher.join()
        assert seen and all("w0" in table for table in seen), \
            "the rank vanished from the member table while its record moved"
    finally:
        stop.set()
        relay.close()
        node.close()
        for client in (reader, rank_etcd):
            client.close()


RANK_PROCESS = """
import sys, threading, time
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.membership.etcd import EtcdMembership
from phalanx.runtime.worker.heartbeat import Heartbeat
from phalanx.runtime.worker.member_relay import MemberRelay
from tests.polling import eventually
endpoint, prefix, host, port, ttl = sys.argv[1:6]
etcd = EtcdMembership([endpoint], prefix, timeout_s=5.0).connect()
relay = MemberRelay(etcd, "w0", lambda: KeeperClient(host, int(port), b"s" * 32, "job",
                                                     timeout_s=0.5))
record = lambda: MemberRecord("w0", 0, "node0", step=1, extra={"time": time.time()})
relay.join(record(), float(ttl))
Heartbeat(relay, 0, "w0", record, lambda: 1, lambda: 0, 0.2, float(ttl), threading.Event(),
          threading.Event()).start()
print("joined", flush=True)
time.sleep(60)
"""


def test_a_rank_frozen_past_its_ttl_vanishes_and_joins_again_when_it_thaws(
        etcd_endpoint: str, prefix: str, shm: Path) -> None:
    """A rank process SIGSTOPped (real signal) beats no more: its keeper drops its record
    after the TTL, as its own lease would lapse; SIGCONT: told it was dropped, its heartbeat
    joins again (the job never replaced it, so it is not fenced)."""
    node = NodeKeeper(etcd_endpoint, prefix, shm)
    reader = EtcdMembership([etcd_endpoint], prefix, timeout_s=5.0).connect()
    rank = subprocess.Popen([sys.executable, "-c", RANK_PROCESS, etcd_endpoint, prefix,
                             *map(str, node.keeper.address), str(TTL_S)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "joined"
        assert eventually(lambda: "w0" in reader.members(), 2.0)
        time.sleep(3 * TTL_S)
        assert "w0" in reader.members()         # alive and idle: kept by its beats
        rank.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert eventually(lambda: "w0" not in reader.members(), 3 * TTL_S + 1)
        # dropped a TTL after its last beat, which came at most a beat before the stop
        assert time.monotonic() - stopped >= TTL_S - 0.4
        rank.send_signal(signal.SIGCONT)
        assert eventually(lambda: "w0" in reader.members(), 3.0)
    finally:
        rank.kill()
        rank.wait()
        node.close()
        reader.close()
