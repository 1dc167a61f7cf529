"""Replication between three in-process keepers over real TCP and real /dev/shm: a ring
of holders, dedup of identical tensors, a chunk corrupted in flight, a slow and a frozen
holder, and generation fencing. Snapshots are real (phalanx.runtime.snapshot.format)."""
from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
import time
from typing import Callable

import pytest
import torch

from phalanx.runtime.replication import (pusher as replica_pusher, receiver as replica_receiver,
                                         wire as replica_wire)
from phalanx.runtime.keeper.shm import allocated_bytes
from phalanx.runtime.node import node_keeper
from phalanx.runtime.keeper.daemon import Keeper, KeeperClient, SlotBusy, owned_names
from phalanx.runtime.replication.pusher import Replicator
from phalanx.runtime.snapshot.format import (Manifest, checksums, make_manifest, plan_layout,
                                             read_tensors, write_into)

SECRET = b"replication-test-secret-0123456789"
SHM = "/dev/shm"
_names = itertools.count()


class _Worker:
    """A training process's side: claims a slot, writes a signed snapshot, publishes."""

    def __init__(self, keeper: Keeper, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        self.keeper, self.rank, self.tensors = keeper, rank, tensors
        self.layout = plan_layout(tensors)
        self.maps: dict[str, mmap.mmap] = {}
        for path in keeper.alloc(rank, self.layout.total_bytes):
            fd = os.open(path, os.O_RDWR)
            self.maps[path] = mmap.mmap(fd, self.layout.total_bytes)
            os.close(fd)

    def publish(self, step: int, generation: int = 1, keep: bool = False) -> bytes | None:
        """Snapshot ``tensors`` as ``step``; with ``keep``, returns a copy of the payload."""
        slot, _ = self.keeper.claim(self.rank)
        return self.publish_claimed(slot, step, generation, keep)

    def publish_claimed(self, slot: int, step: int, generation: int = 1,
                        keep: bool = False) -> bytes | None:
        """``publish`` into a slot already claimed."""
        buf = self.maps[self.keeper._local[self.rank].slots[slot].buf.path]
        write_into(buf, self.layout, self.tensors)
        manifest = make_manifest(self.layout, checksums(buf, self.layout), job=self.keeper.job,
                                 rank=self.rank, step=step, generation=generation,
                                 tree_spec={}, created_at=time.time()).sign(SECRET)
        self.keeper.publish(self.rank, step, slot, manifest.to_json(), self.layout.total_bytes)
        return bytes(buf[:self.layout.total_bytes]) if keep else None

    def close(self) -> None:
        for mm in self.maps.values():
            mm.close()


class _Events:
    """on_event sink with waiting."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._cond = threading.Condition()

    def __call__(self, event: dict) -> None:
        with self._cond:
            self.items.append(event)
            self._cond.notify_all()

    def wait(self, match: Callable[[dict], bool], timeout: float = 10.0) -> dict:
        with self._cond:
            assert self._cond.wait_for(lambda: any(match(e) for e in self.items), timeout), \
                f"no matching event in {self.items}"
            return next(e for e in self.items if match(e))

    def of(self, kind: str, **fields: object) -> list[dict]:
        with self._cond:
            return [e for e in self.items if e["event"] == kind
                    and all(e.get(k) == v for k, v in fields.items())]


def _tensors(seed: int, sizes: tuple[int, ...] = (65536, 16384, 4096)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def fence():
    return {"generation": 1}


@pytest.fixture
def keepers(fence):
    """Keepers of nodes a, b, c of one job; checks that close() leaves no shm file."""
    job = f"rp{os.getpid()}-{next(_names)}"
    started = {}
    try:
        for node in "abc":
            started[node] = node_keeper(node, job, SECRET, SHM, slots=2, claim_wait_s=5.0,
                                   generation_check=lambda g: g >= fence["generation"]).start()
        yield started
    finally:
        for k in started.values():
            k.close()
        for k in started.values():
            assert owned_names(SHM, k.prefix) == [], f"keeper {k.node} left shm files"


@pytest.fixture
def cleanup():
    """Close what a test opened, in reverse order (replicators before workers), then
    check that no sender thread outlived its Replicator."""
    items: list = []
    yield items.append
    for item in reversed(items):
        item.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("replicate-")]


def _replicator(keepers: dict[str, Keeper], node: str, cleanup, **kwargs) -> Replicator:
    rep = Replicator(keepers[node], node, secret=SECRET, job=keepers[node].job,
                     **{"poll_s": 0.01, "timeout_s": 5.0, **kwargs})
    cleanup(rep)
    return rep


def _addresses(keepers: dict[str, Keeper]) -> dict[str, tuple[str, int]]:
    return {node: k.address for node, k in keepers.items()}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_ring_replicates_identical_verified_bytes(keepers, cleanup):
    ranks = {"a": 0, "b": 1, "c": 2}
    holder = {"a": "b", "b": "c", "c": "a"}
    workers, events, reps = {}, _Events(), {}
    for node, rank in ranks.items():
        workers[node] = _Worker(keepers[node], rank, _tensors(rank))
        cleanup(workers[node])
    for node, rank in ranks.items():
        reps[node] = _replicator(keepers, node, cleanup, on_event=events)
        reps[node].set_targets(1, {rank: [holder[node]]}, _addresses(keepers))
        reps[node].start()
    payloads = {}
    for step in (1, 2):
        for node, rank in ranks.items():
            workers[node].tensors["p0"][0] = float(step)
            payloads[rank, step] = workers[node].publish(step, keep=True)
        for node, rank in ranks.items():
            _wait(lambda: step in reps[node].replicated_steps(rank))
    for node, rank in ranks.items():
        assert reps[node].replicated() == {rank: {holder[node]: [1, 2]}}
        target = keepers[holder[node]]
        with KeeperClient(*target.address, SECRET, target.job, generation=1) as client:
            for step in (1, 2):
                got_step, raw_manifest, payload = client.get(rank, step)
                assert got_step == step and bytes(payload) == payloads[rank, step]
                manifest = Manifest.from_json(raw_manifest)
                manifest.verify(SECRET)
                got = read_tensors(payload, verify_against=manifest)
                assert torch.equal(got["p1"], workers[node].tensors["p1"])
        assert target.holdings()[rank]["replica"] == [1, 2]
    pushed = events.of("replica_pushed")
    assert {(e["rank"], e["step"], e["target"]) for e in pushed} == \
        {(r, s, holder[n]) for n, r in ranks.items() for s in (1, 2)}
    assert not events.of("replica_failed")
    # Step 2 changed p0 only: p1 and p2 came from the holder's copy of step 1.
    second = [e for e in pushed if e["step"] == 2]
    assert all(e["bytes_saved"] == (16384 + 4096) * 4 for e in second), second


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_identical_ranks_are_not_sent_twice(keepers, cleanup):
    tensors = _tensors(7)
    first, second = _Worker(keepers["a"], 0, tensors), _Worker(keepers["a"], 1, tensors)
    cleanup(first)
    cleanup(second)
    events = _Events()
    rep = _replicator(keepers, "a", cleanup, on_event=events)
    rep.set_targets(1, {0: ["b"], 1: ["b"]}, _addresses(keepers))
    rep.start()
    first.publish(1)
    full = events.wait(lambda e: e.get("rank") == 0)
    original = second.publish(1, keep=True)
    dedup = events.wait(lambda e: e.get("rank") == 1)
    tensor_bytes = sum(t.numel() * 4 for t in tensors.values())
    assert full["event"] == dedup["event"] == "replica_pushed"
    assert full["bytes_saved"] == 0 and full["bytes_sent"] > tensor_bytes
    assert dedup["bytes_saved"] == tensor_bytes
    assert dedup["bytes_sent"] < full["bytes_sent"] - tensor_bytes + 256
    assert rep.stats()["bytes_saved"] == tensor_bytes
    # one copy per node: rank 1's replica keeps rank 0's replica's bytes, not a copy, and
    # reads the same once rank 0's replica is forgotten (its map stays while shared)
    assert keepers["b"].stats()["shared_bytes"] == tensor_bytes
    assert keepers["b"].drop(0, below_step=2) == {"local": [], "replica": [1]}
    with KeeperClient(*keepers["b"].address, SECRET, keepers["b"].job, generation=1) as client:
        _, raw_manifest, payload = client.get(1, 1)
    assert bytes(payload) == original
    read_tensors(payload, verify_against=Manifest.from_json(raw_manifest))


def _resident(keeper: Keeper, rank: int, kind: str) -> int:
    return sum(allocated_bytes(f["path"]) for f in keeper.snapshot_files(rank)
               if f["kind"] == kind)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_replica_keeps_one_copy_per_node_until_a_claim_needs_the_slot_it_shares(
        keepers, cleanup):
    """Data-parallel ranks 0 (node a) and 1 (node b) snapshot the same replicated
    tensors: rank 1's replica on a holds references to rank 0's own slot, not a second
    copy, reads back byte for byte (streamed and borrowed), and once rank 0's worker
    needs that slot again the replica copies the bytes in first."""
    tensors = _tensors(11)
    local = _Worker(keepers["a"], 0, {k: v.clone() for k, v in tensors.items()})
    peer = _Worker(keepers["b"], 1, tensors)
    cleanup(local)
    cleanup(peer)
    tensor_bytes = sum(t.numel() * 4 for t in tensors.values())
    local.publish(1)
    original = peer.publish(1, keep=True)
    assert original is not None and tensor_bytes >= replica_pusher.OFFER_MIN_BYTES
    events = _Events()
    rep = _replicator(keepers, "b", cleanup, on_event=events)
    rep.set_targets(1, {1: ["a"]}, _addresses(keepers))
    rep.start()
    pushed = events.wait(lambda e: e["event"] == "replica_pushed")
    assert pushed["bytes_saved"] == tensor_bytes
    holder = keepers["a"]
    assert holder.stats()["shared_bytes"] == tensor_bytes
    own = _resident(holder, 0, "own")
    assert own >= tensor_bytes
    assert _resident(holder, 1, "replica") <= len(original) - tensor_bytes + 2 * mmap.PAGESIZE

    def read_back() -> None:
        with KeeperClient(*holder.address, SECRET, holder.job, generation=1) as client:
            step, raw_manifest, payload = client.get(1, 1)
            assert step == 1 and bytes(payload) == original
            read_tensors(payload, verify_against=Manifest.from_json(raw_manifest))
            with client.borrow(1, 1) as (step, _, view):
                assert step == 1 and bytes(view) == original

    read_back()
    # rank 0 trains on: step 2 goes to its other slot, step 3 needs the shared one
    local.tensors["p0"].add_(1.0)
    local.publish(2)
    local.tensors["p0"].add_(1.0)
    local.publish(3)
    assert holder.holdings()[0]["local"] == [2, 3]
    assert holder.stats()["shared_bytes"] == 0
    assert _resident(holder, 1, "replica") >= len(original) - mmap.PAGESIZE
    read_back()


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_an_offer_waits_briefly_for_a_local_capture_in_flight(keepers, cleanup):
    """The tensors a local rank is capturing now are the ones a peer's replica of the
    same step shares: the offer waits for that publish (bounded), not for a slot claimed
    ahead by a rank that already published the step, nor without a claim."""
    keeper = keepers["a"]
    worker = _Worker(keeper, 0, _tensors(5))
    cleanup(worker)
    started = time.monotonic()
    keeper.settle_local_writes(1, 5.0)
    assert time.monotonic() - started < 0.1          # nothing is being written
    slot, _ = keeper.claim(0)
    publisher = threading.Timer(0.3, worker.publish_claimed, args=(slot, 1))
    publisher.start()
    try:
        started = time.monotonic()
        keeper.settle_local_writes(1, 5.0)
        waited = time.monotonic() - started
    finally:
        publisher.join()
    assert 0.25 <= waited < 4.0, waited
    assert keeper.holdings()[0]["local"] == [1]
    keeper.claim(0)                   # claimed ahead (as a worker does after a publish) ...
    started = time.monotonic()
    keeper.settle_local_writes(1, 5.0)  # ... for a step after the one on offer: no wait
    assert time.monotonic() - started < 0.1
    started = time.monotonic()
    keeper.settle_local_writes(2, 0.3)  # the offer's step is not published: bounded wait
    assert 0.25 <= time.monotonic() - started < 2.0


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_chunk_corrupted_in_flight_is_refused_then_a_clean_push_lands(keepers, cleanup,
                                                                      monkeypatch):
    worker = _Worker(keepers["a"], 0, _tensors(3))
    cleanup(worker)
    events, corrupt = _Events(), threading.Event()
    corrupt.set()
    send = replica_wire.send_chunk

    def flip_after_digest(sock, windows, digest):
        if corrupt.is_set():
            bad = bytearray(windows[-1])
            bad[len(bad) // 2] ^= 0x40
            windows = [*windows[:-1], memoryview(bad)]
        send(sock, windows, digest)

    monkeypatch.setattr(replica_wire, "send_chunk", flip_after_digest)
    rep = _replicator(keepers, "a", cleanup, on_event=events, chunk_bytes=64 << 10,
                      max_backoff_s=0.2)
    rep.set_targets(1, {0: ["b"]}, _addresses(keepers))
    rep.start()
    original = worker.publish(1, keep=True)
    failed = events.wait(lambda e: e["event"] == "replica_failed")
    assert failed["step"] == 1 and failed["target"] == "b" and not failed["preempted"]
    assert "SnapshotCorrupt" in failed["error"] and "digest" in failed["error"]
    assert keepers["b"].holdings() == {} and rep.replicated_steps(0) == set()
    corrupt.clear()
    pushed = events.wait(lambda e: e["event"] == "replica_pushed")
    assert pushed["step"] == 1 and rep.replicated_steps(0) == {1}
    with KeeperClient(*keepers["b"].address, SECRET, keepers["b"].job, generation=1) as client:
        assert bytes(client.get(0, 1)[2]) == original


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_slow_holder_skips_intermediate_steps_and_never_blocks_publish(keepers, cleanup,
                                                                        monkeypatch):
    receive = replica_receiver.receive_chunk

    def slow(*args, **kwargs):
        time.sleep(0.05)
        receive(*args, **kwargs)

    monkeypatch.setattr(replica_receiver, "receive_chunk", slow)
    in_flight, most = [0], [0]
    push = replica_wire.ReplicaLink.push

    def counted(self, *args, **kwargs):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            return push(self, *args, **kwargs)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(replica_wire.ReplicaLink, "push", counted)
    tensors = _tensors(5, (262144, 65536))  # 1.25 MiB: 20 chunks of 64 KiB, >= 1 s a push
    worker = _Worker(keepers["a"], 0, tensors)
    cleanup(worker)
    events = _Events()
    rep = _replicator(keepers, "a", cleanup, on_event=events, chunk_bytes=64 << 10)
    rep.set_targets(1, {0: ["b"]}, _addresses(keepers))
    rep.start()
    worker.publish(1)  # warm up (first connection, lazy imports), then 20 steps quickly
    _wait(lambda: rep.replicated_steps(0) == {1})
    latencies, pins = [], []
    for step in range(2, 22):
        for t in tensors.values():
            t[0] = float(step)  # every tensor changes: no push deduplicates
        started = time.perf_counter()
        worker.publish(step)
        latencies.append(time.perf_counter() - started)
        pins.append(sum(h.pins for h in keepers["a"]._local[0].slots))
        time.sleep(0.02)
    _wait(lambda: 21 in rep.replicated_steps(0), timeout=20)
    pushed = [e["step"] for e in events.of("replica_pushed")][1:]
    assert pushed == sorted(set(pushed)) and pushed[-1] == 21 and len(pushed) < 10, pushed
    assert all(e["bytes_saved"] == 0 for e in events.of("replica_pushed"))
    assert most[0] == 1 and max(pins) <= 1  # one push in flight, one slot pinned: no queue
    assert max(latencies) < 0.5, latencies  # the claim preempted the push, never waited
    assert len(rep._targets["b"].held[0]) <= keepers["b"].replica_keep
    preempted = [e for e in events.of("replica_failed") if e["preempted"]]
    assert preempted and not [e for e in events.of("replica_failed") if not e["preempted"]]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_frozen_holder_does_not_block_the_others(keepers, cleanup):
    frozen = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never answers
    cleanup(frozen)
    worker = _Worker(keepers["a"], 0, _tensors(11))
    cleanup(worker)
    events = _Events()
    rep = _replicator(keepers, "a", cleanup, on_event=events, timeout_s=1.5)
    rep.set_targets(1, {0: ["z", "b", "c"]}, {**_addresses(keepers), "z": frozen.getsockname()})
    rep.start()
    started = time.monotonic()
    worker.publish(1)
    for node in "bc":
        events.wait(lambda e: e["event"] == "replica_pushed" and e["target"] == node)
    assert time.monotonic() - started < 1.5  # within the frozen holder's timeout
    failed = events.wait(lambda e: e["event"] == "replica_failed", timeout=5)
    assert failed["target"] == "z" and "PeerUnreachable" in failed["error"]
    assert rep.replicated() == {0: {"z": [], "b": [1], "c": [1]}}
    assert rep.replicated_steps(0) == set()
    closing = time.monotonic()
    rep.close()
    assert time.monotonic() - closing < 1.0
    assert not [t for t in threading.enumerate() if t.name.startswith("replicate-")]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_new_generation_fences_old_pushes_and_moves_targets(keepers, cleanup, fence):
    worker = _Worker(keepers["a"], 0, _tensors(13))
    cleanup(worker)
    events = _Events()
    rep = _replicator(keepers, "a", cleanup, on_event=events, max_backoff_s=0.2)
    rep.set_targets(1, {0: ["b"]}, _addresses(keepers))
    rep.start()
    worker.tensors["p0"][0] = 1.0
    worker.publish(1)
    _wait(lambda: rep.replicated_steps(0) == {1})
    fence["generation"] = 2  # the coordinator fenced generation 1
    worker.tensors["p0"][0] = 2.0
    worker.publish(2, generation=2)
    failed = events.wait(lambda e: e["event"] == "replica_failed" and e["step"] == 2)
    assert "StaleGeneration" in failed["error"] or "generation" in failed["error"]
    assert keepers["b"].holdings()[0]["replica"] == [1]
    rep.set_targets(2, {0: ["c"]}, _addresses(keepers))
    _wait(lambda: rep.replicated_steps(0) == {2})
    assert rep.replicated() == {0: {"c": [2]}}
    _wait(lambda: [t.name for t in threading.enumerate() if t.name.startswith("replicate-")]
          == ["replicate-a-to-c"])
    assert keepers["b"].holdings()[0]["replica"] == [1]
    assert keepers["c"].holdings()[0]["replica"] == [2]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_claim_preempts_a_push_pin_but_waits_for_other_readers(keepers):
    keeper = keepers["a"]
    worker = _Worker(keeper, 0, _tensors(17))
    try:
        worker.publish(1)
        worker.publish(2)  # slots hold steps 1 and 2 (the newest, never claimed)
        calls = []

        def on_claim():  # what a Replicator's push does: signal, unpin a moment later
            calls.append("preempted")
            threading.Timer(0.05, keeper.unpin, (held, on_claim)).start()

        _, held = keeper.pin(0, 1, on_claim=on_claim)
        started = time.monotonic()
        slot, _ = keeper.claim(0)
        assert calls == ["preempted"] and time.monotonic() - started < 1.0
        assert held.pins == 0 and held.yielding == []
        keeper.publish(0, 3, slot, b"{}", worker.layout.total_bytes)
        _, reader = keeper.pin(0, 2)  # a plain reader (restore, persister) is waited for
        keeper._claim_wait_s = 0.2
        with pytest.raises(SlotBusy):
            keeper.claim(0)
        keeper.unpin(reader)
    finally:
        worker.close()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_chunk_plan_and_digests():
    segments = replica_wire.sent_segments(100, [(10, 20), (50, 5)])
    assert segments == [(0, 10), (30, 20), (55, 45)]
    chunks = list(replica_wire.iter_chunks(segments, 16))
    assert chunks == [[(0, 10), (30, 6)], [(36, 14), (55, 2)], [(57, 16)], [(73, 16)],
                      [(89, 11)]]
    assert replica_wire.push_nbytes(7, segments, 16) == 7 + 75 + 5 * 8
    data = bytearray(os.urandom(1000) + b"\x00" * 3)
    for algo in replica_wire.CHUNK_DIGESTS:
        parts = [memoryview(data)[:501], memoryview(data)[501:]]
        digest = replica_wire.chunk_digest(parts, algo)
        for at in range(0, len(data), 37):  # any flipped byte changes the digest
            data[at] ^= 0x01
            assert replica_wire.chunk_digest(parts, algo) != digest
            data[at] ^= 0x01
        assert replica_wire.chunk_digest(parts, algo) == digest
    manifest = b'{"tensors": {"a": {"offset": 8, "nbytes": 4096, "checksum": "sha256:00"},' \
               b' "b": {"offset": 4104, "nbytes": 4096, "checksum": "crc32:0000abcd"}}}'
    tensors = replica_wire.tensor_ranges(manifest, 8200)
    assert replica_wire.dedup_candidates(tensors) == [0]  # crc32 never deduplicates
    assert replica_wire.tensor_ranges(manifest, 8199) == []  # b runs past the payload
    assert replica_wire.tensor_ranges(b'{"step": 1}', 10) == []


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_publish_wakes_the_sender_without_waiting_for_a_poll(keepers, cleanup):
    """Pushes follow publishes at once (no polling delay), small snapshots skip the offer,
    and the keeper reports each push's seconds as the rank's replication cost."""
    worker = _Worker(keepers["a"], 0, _tensors(3, (1024, 256)))     # 5 KiB: no offer
    cleanup(worker)
    events = _Events()
    rep = _replicator(keepers, "a", cleanup, on_event=events, poll_s=30.0)
    rep.set_targets(1, {0: ["b"]}, _addresses(keepers))
    rep.start()
    time.sleep(0.2)                       # the sender is parked in its (30 s) wait
    for step in (1, 2):
        started = time.monotonic()
        worker.publish(step)
        pushed = events.wait(lambda e, s=step: e.get("step") == s)
        assert pushed["event"] == "replica_pushed"
        assert time.monotonic() - started < 5.0
    _, held = keepers["a"].pin(0, 2)
    try:
        no_offer = replica_wire.push_nbytes(len(held.manifest), [(0, held.used)],
                                            rep.chunk_bytes)
    finally:
        keepers["a"].unpin(held)
    assert pushed["bytes_sent"] == no_offer, "an offer was sent too"
    assert keepers["a"].replication_cost(0) == pytest.approx(pushed["seconds"])
