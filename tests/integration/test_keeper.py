"""The node keeper over real TCP and real /dev/shm: a worker process killed mid-write,
replicas and retention, layout changes, fencing, the keeper as a process, throughput."""
from __future__ import annotations

import itertools
import json
import mmap
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.configs.errors import ConfigError, SnapshotNotFound, StaleGeneration
from phalanx.runtime.keeper.daemon import (Keeper, KeeperClient, KeeperRequestInvalid, SlotBusy,
                                           check_capacity, memory_plan, owned_names)
from phalanx.runtime.transport.tcp import PeerRefused

SECRET = b"keeper-test-secret-0123456789abc"
SHM = "/dev/shm"
REPO = Path(__file__).resolve().parents[2]
_names = itertools.count()

WORKER = r"""
import json, mmap, os, sys, time
from phalanx.runtime.keeper.daemon import KeeperClient
host, port, job, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4])
n = int(sys.argv[5])
pattern = lambda step: step.to_bytes(8, "little") * (n // 8)
client = KeeperClient(host, port, secret, job, generation=1)
client.alloc(0, n)
for step in (1, 2, 3):
    slot, path = client.claim(0)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, n)
    os.close(fd)
    if step == 3:
        mm[: n // 2] = pattern(3)[: n // 2]
        print("WRITING", slot, flush=True)
        time.sleep(60)
    mm[:] = pattern(step)
    mm.close()
    client.publish(0, step, slot, json.dumps({"step": step}).encode(), n)
"""


def _pattern(step: int, n: int) -> bytes:
    return step.to_bytes(8, "little") * (n // 8)


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, len(data)) as mm:
            mm[:] = data
    finally:
        os.close(fd)


def _publish(client: KeeperClient, rank: int, step: int, data: bytes) -> int:
    slot, path = client.claim(rank)
    _write(path, data)
    client.publish(rank, step, slot, json.dumps({"step": step}).encode(), len(data))
    return slot


@pytest.fixture
def fence():
    return {"generation": 1}


@pytest.fixture
def keeper(fence):
    job = f"kt{os.getpid()}-{next(_names)}"
    k = Keeper("n0", job, SECRET, SHM, slots=2, claim_wait_s=0.3,
               generation_check=lambda g: g >= fence["generation"])
    k.start()
    yield k
    k.close()
    assert owned_names(SHM, k.prefix) == [], "keeper.close() left shm files behind"


@pytest.fixture
def client(keeper):
    with KeeperClient(*keeper.address, SECRET, keeper.job, timeout_s=10.0, generation=1) as c:
        yield c


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_worker_killed_mid_write_leaves_last_published_step(keeper, client):
    n = 4 << 20
    proc = subprocess.Popen([sys.executable, "-c", WORKER, *map(str, keeper.address),
                             keeper.job, SECRET.hex(), str(n)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=20), "worker did not reach step 3"
        line = proc.stdout.readline().split()
        assert line[0] == "WRITING"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
    held = client.holdings()[0]
    assert held == {"local": [2], "replica": [], "writing": True}
    step, manifest, payload = client.get(0)
    assert (step, json.loads(manifest)) == (2, {"step": 2})
    assert payload == _pattern(2, n)
    assert client.latest(0) == 2
    for gone in (1, 3):
        with pytest.raises(SnapshotNotFound, match=f"rank 0 at step {gone}"):
            client.get(0, gone)
    # The restarted worker reuses the half-written slot, never the one holding step 2.
    assert client.claim(0)[0] == int(line[1])


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_replicas_retention_and_stats(keeper, client):
    n = 1 << 20
    with KeeperClient(*keeper.address, SECRET, keeper.job, role="peer", generation=1) as peer:
        payloads = {step: os.urandom(n) for step in range(1, 5)}
        evicted = [peer.put_replica(7, step, b'{"r":7}', payloads[step]) for step in payloads]
        assert evicted == [[], [], [1], [2]]
        step, manifest, payload = client.get(7, 3)
        assert (step, manifest, payload) == (3, b'{"r":7}', payloads[3])
        assert client.get(7)[0] == 4
        client.alloc(0, n)
        for step in range(1, 6):
            _publish(client, 0, step, _pattern(step, n))
            assert client.holdings()[0]["local"] == list(range(max(1, step - 1), step + 1))
        stats = peer.stats()
    resident = stats.pop("resident_bytes")      # (pages: what was written and still held)
    assert 2 * n <= resident <= 5 * n
    assert stats == {"local_bytes": 2 * n, "replica_bytes": 2 * n, "free_bytes": n, "files": 5,
                     "shared_bytes": 0, "ranks_local": 1, "ranks_replica": 1}
    assert client.holdings()[7] == {"local": [], "replica": [3, 4], "writing": False}
    assert client.drop(None, below_step=5) == {"local": [4], "replica": [3, 4]}
    assert client.holdings()[0]["local"] == [5]
    assert client.drop(0, above_step=4) == {"local": [5], "replica": []}


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_layout_change_serves_old_step_until_new_one_is_published(keeper, client):
    n = 1 << 20
    old = client.alloc(0, n)
    assert client.alloc(0, n) == old
    _publish(client, 0, 1, _pattern(1, n))
    old_slot = _publish(client, 0, 2, _pattern(2, n))
    new = client.alloc(0, 2 * n)  # e.g. Adam state appeared
    assert set(new).isdisjoint(old) and all(os.path.getsize(p) == 2 * n for p in new)
    assert [os.path.exists(p) for p in old] == [i == old_slot for i in range(2)]
    assert client.get(0)[0] == 2 and client.get(0)[2] == _pattern(2, n)
    slot, path = client.claim(0)
    assert path in new
    assert client.get(0)[0] == 2  # still served while the new layout is being written
    _write(path, _pattern(3, 2 * n))
    client.publish(0, 3, slot, b"{}", 2 * n)
    assert not any(os.path.exists(p) for p in old)
    assert client.get(0)[2] == _pattern(3, 2 * n)
    assert client.stats()["local_bytes"] == 4 * n


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_generation_fencing(keeper, client, fence):
    client.alloc(0, 4096)
    fence["generation"] = 2
    with pytest.raises(StaleGeneration, match="generation 1 is fenced"):
        client.claim(0)
    assert client.holdings() == {0: {"local": [], "replica": [], "writing": False}}
    with KeeperClient(*keeper.address, SECRET, keeper.job, generation=1) as late:
        with pytest.raises(PeerRefused) as info:
            late.ping()
        assert info.value.code == "generation"
    client.generation = 2
    assert client.claim(0)[0] in (0, 1)


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_claim_never_overwrites_a_slot_being_read(keeper, client):
    n = 4096
    client.alloc(0, n)
    _publish(client, 0, 1, _pattern(1, n))
    _publish(client, 0, 2, _pattern(2, n))
    source, held = keeper.pin(0, 1)  # a peer streaming step 1
    with pytest.raises(SlotBusy):
        client.claim(0)
    keeper.unpin(held)
    with pytest.raises(SlotBusy, match="protect_step=1"):
        client.claim(0, protect_step=1)  # step 1 is the committed one: keep it
    slot, _ = client.claim(0)
    assert client.holdings()[0] == {"local": [2], "replica": [], "writing": True}
    with pytest.raises(KeeperRequestInvalid, match="not claimed"):
        client.publish(0, 3, 1 - slot, b"{}", n)
    with pytest.raises(KeeperRequestInvalid, match="do not fit"):
        client.publish(0, 3, slot, b"{}", n + 1)
    with pytest.raises(KeeperRequestInvalid, match="no slots"):
        client.claim(9)


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_keeper_process_writes_port_and_exits_clean_on_sigterm(tmp_path):
    job = f"kp{os.getpid()}"
    prefix = f"phalanx-{job}-n1-"
    stale = Path(SHM, f"{prefix}x99")
    stale.write_bytes(b"left by a killed keeper")
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.runtime.node", "--node", "n1", "--job", job,
                             "--secret-file", str(tmp_path / "secret"), "--port-file",
                             str(port_file)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not port_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        port = int(port_file.read_text())
        assert not stale.exists()
        with KeeperClient("127.0.0.1", port, SECRET, job) as c:
            assert c.ping()["node"] == "n1"
            c.alloc(3, 1 << 20)
            assert len(owned_names(SHM, prefix)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        err = proc.stderr.read()
        proc.stderr.close()
    assert "keeper.closed node=n1 files=2" in err
    assert owned_names(SHM, prefix) == []


@pytest.mark.integration
@pytest.mark.timeout(40)
def test_throughput_of_256mib_over_loopback(keeper, client):
    n = 256 << 20
    data = os.urandom(1 << 20) * 256
    client.alloc(0, n)
    slot, path = client.claim(0)
    _write(path, data)
    client.publish(0, 1, slot, b"{}", n)
    with mmap.mmap(-1, n) as dest:
        timings = []
        for _ in range(2):  # into fresh pages first, then into pages already touched
            started = time.perf_counter()
            assert client.get_into(0, memoryview(dest))[2] == n
            timings.append(time.perf_counter() - started)
        assert dest[:] == data
    started = time.perf_counter()
    payload = client.get(0)[2]
    get_s = time.perf_counter() - started
    assert len(payload) == n
    started = time.perf_counter()
    client.put_replica(1, 1, b"{}", memoryview(payload))
    put_s = time.perf_counter() - started
    mb = n / 1e6
    print(f"\nkeeper 256 MiB over loopback: get_into(fresh mmap) {mb / timings[0]:.0f} MB/s, "
          f"get_into(touched mmap) {mb / timings[1]:.0f} MB/s, get(bytearray) "
          f"{mb / get_s:.0f} MB/s, put_replica {mb / put_s:.0f} MB/s")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_memory_plan_and_capacity_check(tmp_path):
    # 4 local ranks x 2 slots + 4 replicated ranks x (2 kept + 1 receive buffer)
    assert memory_plan(100, 4, 2, 1, 2) == 100 * 4 * 2 + 100 * 4 * 3
    assert memory_plan(100, 4, 2, 0, 2) == 800
    check_capacity(1 << 20, SHM)
    with pytest.raises(ConfigError) as info:
        check_capacity(1 << 60, SHM)
    assert info.value.key == "snapshot.shm_dir" and "GiB" in info.value.problem
    with pytest.raises(ConfigError, match="not a directory"):
        check_capacity(1, str(tmp_path / "missing"))
    for bad in ("a/b", "..", "n-1", ""):
        with pytest.raises(ConfigError):
            Keeper(bad, "job", SECRET)



@pytest.mark.integration
@pytest.mark.timeout(30)
def test_a_borrowed_slot_is_mapped_pinned_and_released_when_given_back_or_cut(keeper, client):
    """A reader on the keeper's host maps the slot itself; while it holds the loan the
    worker's claims never take that slot (with 2 slots: SlotBusy), and the loan ends with
    the block or with the reader's connection."""
    n = 1 << 20
    client.alloc(0, n)
    _publish(client, 0, 1, _pattern(1, n))
    _publish(client, 0, 2, _pattern(2, n))
    with KeeperClient(*keeper.address, SECRET, keeper.job, role="restore", generation=1) as reader:
        with reader.borrow(0, 1) as (step, manifest, payload):
            assert (step, json.loads(manifest)) == (1, {"step": 1})
            assert payload.readonly and bytes(payload) == _pattern(1, n)
            with pytest.raises(SlotBusy):       # step 2 is the newest, step 1 is on loan
                client.claim(0)
    _publish(client, 0, 3, _pattern(3, n))      # given back: step 1's slot was reused
    assert client.holdings()[0]["local"] == [2, 3]
    cut = KeeperClient(*keeper.address, SECRET, keeper.job, role="restore", generation=1)
    loan = cut.borrow(0, 2)
    assert loan.__enter__()[0] == 2
    with pytest.raises(SlotBusy):
        client.claim(0)
    cut._frames.close()                          # the reader's connection dies mid-loan
    deadline = time.monotonic() + 5
    while True:
        try:
            client.claim(0)
            break
        except SlotBusy:
            assert time.monotonic() < deadline, "the loan outlived its connection"
    loan.__exit__(None, None, None)              # giving back a loan that died is quiet
    cut.close()
    with pytest.raises(KeeperRequestInvalid, match="names nothing lent"):
        client._call({"op": "give_back", "token": 99})


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_replication_ops_come_only_through_the_op_port(keeper, fence):
    """A plain keeper serves no replication op (the keeper never imports replication); the
    node keeper registers replication's receiving ops, fenced like the keeper's own writes."""
    from phalanx.runtime.node import node_keeper
    from phalanx.runtime.transport.tcp import Reply

    offer = {"op": "replica_offer", "rank": 0, "size": 8}
    with KeeperClient(*keeper.address, SECRET, keeper.job, generation=1) as plain:
        with pytest.raises(KeeperRequestInvalid, match="unknown op 'replica_offer'"):
            plain._call(offer)
    seen: list[str] = []
    extra = {"echo": lambda k, request: seen.append(k.node) or Reply({"node": k.node})}
    job = f"kt{os.getpid()}-{next(_names)}"
    with Keeper("n1", job, SECRET, SHM, ops=extra,
                generation_check=lambda g: g >= fence["generation"]) as ported:
        with KeeperClient(*ported.address, SECRET, job, generation=1) as client:
            assert client._call({"op": "echo"})["node"] == "n1" and seen == ["n1"]
            fence["generation"] = 2                     # a registered op is a fenced write
            with pytest.raises(StaleGeneration):
                client._call({"op": "echo"})
    with node_keeper("n2", job, SECRET, SHM) as served:
        with KeeperClient(*served.address, SECRET, job, generation=1) as client:
            answer = client._call(offer)       # served: an offer of nothing needs nothing
            assert answer["have"] == [] and answer["held"] == [] and answer["check"]
