"""The tier persister over real keepers in /dev/shm: two nodes each persisting their own
ranks to a shared disk, memory or S3 tier, the commit written by the last node, retention,
a failing tier that only degrades, and a step overwritten before it was read."""
from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import safetensors.torch
import torch

from phalanx.configs.errors import SnapshotNotFound
from phalanx.configs.schema import S3TierConfig
from phalanx.runtime.base import Tier
from phalanx.runtime.keeper.daemon import Keeper, KeeperClient, owned_names
from phalanx.runtime.tiers.persister import TierPersister
from phalanx.runtime.snapshot.format import (Manifest, checksums, make_manifest, plan_layout,
                                             read_tensors, write_into)
from phalanx.runtime.tiers.disk import DiskTier
from tests.fakes.tier_memory import MemoryTier
from phalanx.runtime.tiers.s3 import S3Tier

SECRET = b"persister-test-secret-0123456789"
SHM = "/dev/shm"
WORLD = [0, 1, 2, 3]
NODES = {"n0": [0, 2], "n1": [1, 3]}
_names = itertools.count()


def _tensors(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((96, 64), float(rank * 1000 + step)),
            "i": torch.arange(50, dtype=torch.int64) + step,
            "h": torch.ones(7, dtype=torch.float16) * rank}


class Events:
    """Thread-safe event log fed by a persister's ``on_event``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.items.append(event)

    def of(self, kind: str, tier: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.items if e["event"] == kind
                    and (tier is None or e.get("tier") == tier)]


class Node:
    """A keeper, a worker-side client publishing its ranks, and the node's persister."""

    def __init__(self, name: str, job: str, ranks: list[int],
                 tiers: list[tuple[Tier, int, int]], *, world: list[int] = WORLD,
                 keeper_factory: Callable[..., Keeper] = Keeper) -> None:
        self.ranks = ranks
        self.job = job
        self.keeper = keeper_factory(name, job, SECRET, SHM, slots=2, claim_wait_s=5.0)
        self.keeper.start()
        self.client = KeeperClient(*self.keeper.address, SECRET, job, timeout_s=10.0)
        self.events = Events()
        self.persister = TierPersister(self.keeper, tiers, world, ranks, poll_s=0.02,
                                       on_event=self.events, commit_retry_s=0.02)
        self.persister.start()
        self.published: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    def publish(self, step: int) -> None:
        """Each rank's worker: claim, write through its own mmap, publish. Rank 3 publishes
        its whole (larger) slot: the persister must write only manifest.total_bytes."""
        for rank in self.ranks:
            tensors = _tensors(rank, step)
            layout = plan_layout(tensors)
            slot_bytes = layout.total_bytes + 4096
            self.client.alloc(rank, slot_bytes)
            slot, path = self.client.claim(rank)
            fd = os.open(path, os.O_RDWR)
            try:
                with mmap.mmap(fd, slot_bytes) as mm:
                    write_into(mm, layout, tensors)
                    sums = checksums(mm, layout)
                    payload = mm[:layout.total_bytes]
            finally:
                os.close(fd)
            manifest = make_manifest(layout, sums, job=self.job, rank=rank, step=step,
                                     generation=1, tree_spec={"step": step},
                                     created_at=time.time()).sign(SECRET).to_json()
            size = slot_bytes if rank == 3 else layout.total_bytes
            self.client.publish(rank, step, slot, manifest, size)
            self.published[(rank, step)] = (payload, manifest)

    def close(self) -> None:
        self.persister.close()
        self.client.close()
        self.keeper.close()
        assert owned_names(SHM, self.keeper.prefix) == [], "keeper left shm files behind"


def _wait(predicate: Callable[[], Any], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _persister_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("persister-")]


@pytest.fixture
def job() -> str:
    return f"pt{os.getpid()}-{next(_names)}"


@pytest.fixture
def cluster(job: str) -> Iterator[Callable[..., dict[str, Node]]]:
    """Build the two nodes with per-node tiers from ``make_tiers(node_name)``; closes them
    and checks their persister threads were joined."""
    nodes: list[Node] = []

    def build(make_tiers: Callable[[str], list[tuple[Tier, int, int]]]) -> dict[str, Node]:
        for name, ranks in NODES.items():
            nodes.append(Node(name, job, ranks, make_tiers(name)))
        return {n.keeper.node: n for n in nodes}

    yield build
    for node in nodes:
        node.close()
    assert _persister_threads() == [], "persister.close() did not join its thread"


def _assert_payloads(tier: Tier, nodes: dict[str, Node], step: int) -> None:
    """Every rank's persisted bytes equal what its worker published, and open and verify."""
    for node in nodes.values():
        for rank in node.ranks:
            payload, manifest_bytes = tier.read_rank(step, rank)
            assert (payload, manifest_bytes) == node.published[(rank, step)]
            manifest = Manifest.from_json(manifest_bytes)
            manifest.verify(SECRET)
            assert manifest.total_bytes == len(payload)
            tensors = read_tensors(payload, verify_against=manifest)
            loaded = safetensors.torch.load(payload)
            for name, want in _tensors(rank, step).items():
                assert torch.equal(tensors[name], want) and torch.equal(loaded[name], want)


def _run_steps(nodes: dict[str, Node], steps: range, every: int, tiers: list[Tier],
               working: list[str], failing: tuple[str, ...] = ()) -> None:
    """Publish ``steps`` on both nodes. At a persisted step n0 goes first: its ranks reach
    the tiers, yet no marker appears until n1's ranks are there too."""
    first, last = nodes["n0"], nodes["n1"]
    for step in steps:
        first.publish(step)
        if step % every == 0:
            _wait(lambda: all(first.persister.last_persisted().get(t) == step for t in working)
                  and all(_degraded_at(first, t, step) for t in failing),
                  f"n0 persisting step {step}")
            for tier in tiers:
                assert step not in tier.committed_steps(), "committed before all ranks"
        last.publish(step)
        if step % every == 0:
            for node in nodes.values():
                _wait(lambda: all(node.persister.last_committed().get(t) == step
                                  for t in working)
                      and all(_degraded_at(node, t, step) for t in failing),
                      f"{node.keeper.node} committing {step}")


def _degraded_at(node: Node, tier: str, step: int) -> bool:
    return any(e["step"] == step for e in node.events.of("tier_degraded", tier))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_two_nodes_commit_every_fifth_step_with_retention(cluster, job: str,
                                                          tmp_path: Path) -> None:
    memory = MemoryTier(job)  # one shared store, as S3 would be
    nodes = cluster(lambda name: [(DiskTier(tmp_path, job), 5, 1), (memory, 5, 2)])
    disk = DiskTier(tmp_path, job)
    first, last = nodes["n0"], nodes["n1"]
    for step in range(1, 6):
        first.publish(step)
    _wait(lambda: first.persister.last_persisted() == {"disk": 5, "memory": 5}, "n0 step 5")
    for rank in (0, 2):
        assert (disk.step_dir(5) / f"rank_{rank}.safetensors").is_file()
    assert not (disk.step_dir(5) / "COMMIT").exists()  # ranks 1 and 3 are still missing
    assert disk.committed_steps() == [] and memory.committed_steps() == []
    for step in range(1, 6):
        last.publish(step)
    for node in nodes.values():
        _wait(lambda: node.persister.last_committed() == {"disk": 5, "memory": 5},
              f"{node.keeper.node} committing step 5")
    assert disk.committed_steps() == [5] and memory.committed_steps() == [5]
    _assert_payloads(disk, nodes, 5)
    _assert_payloads(memory, nodes, 5)

    _run_steps(nodes, range(6, 11), 5, [disk, memory], ["disk", "memory"])
    _wait(lambda: disk.committed_steps() == [10], "disk retention (keep=1)")
    assert not disk.step_dir(5).exists()
    assert memory.committed_steps() == [5, 10]  # keep=2
    _assert_payloads(disk, nodes, 10)
    _assert_payloads(memory, nodes, 10)
    for node in nodes.values():
        persisted = node.events.of("tier_persisted", "disk")
        assert [e["step"] for e in persisted] == [5, 10]
        assert persisted[0]["ranks"] == node.ranks
        assert persisted[0]["bytes"] == sum(len(node.published[(r, 5)][0]) for r in node.ranks)
        assert node.events.of("tier_degraded") == [] and node.events.of("tier_skipped") == []
    committed = [e["step"] for e in last.events.of("tier_committed", "disk")]
    assert committed == [5, 10], "the last node to finish commits at its first try"
    assert first.events.of("tier_retention", "disk") == [
        {"event": "tier_retention", "tier": "disk", "keep": 1, "deleted": [5]}]
    assert last.events.of("tier_retention") == []  # only the node holding rank 0 retains


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_failing_tier_degrades_while_disk_commits(cluster, job: str, tmp_path: Path) -> None:
    nodes = cluster(lambda name: [(DiskTier(tmp_path, job), 5, 2),
                                  (MemoryTier(job, fail_writes=True), 5, 2)])
    disk = DiskTier(tmp_path, job)
    _run_steps(nodes, range(1, 11), 5, [disk], ["disk"], failing=("memory",))
    assert disk.committed_steps() == [5, 10]
    _assert_payloads(disk, nodes, 10)
    for node in nodes.values():
        degraded = node.events.of("tier_degraded", "memory")
        assert [e["step"] for e in degraded] == [5, 10]
        assert "TierUnavailable" in degraded[0]["error"] and "fail_writes" in degraded[0]["error"]
        assert node.events.of("tier_degraded", "disk") == []
        assert node.persister.last_persisted() == {"disk": 10}
        assert node.persister.last_committed() == {"disk": 10}
        assert node.events.of("persister_error") == []
    assert sorted(_persister_threads()) == ["persister-n0", "persister-n1"]  # still running


class _RacingKeeper(Keeper):
    """A keeper whose worker overwrites step 5 right after the persister saw it held."""

    def pin(self, rank: int, step: int | None = None, **kwargs: Any) -> tuple[str, Any]:
        if step == 5:
            self.drop(None, above_step=4)
        return super().pin(rank, step, **kwargs)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_step_gone_before_read_is_skipped_then_next_one_persists(job: str,
                                                                 tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, job)
    node = Node("n0", job, [0], [(disk, 5, 2)], world=[0], keeper_factory=_RacingKeeper)
    try:
        for step in range(1, 6):
            node.publish(step)
        _wait(lambda: node.events.of("tier_skipped"), "step 5 skipped")
        skipped = node.events.of("tier_skipped")[0]
        assert (skipped["tier"], skipped["step"]) == ("disk", 5)
        assert "no snapshot of rank 0 at step 5" in skipped["reason"]
        with pytest.raises(SnapshotNotFound):
            disk.read_rank(5, 0)
        for step in range(6, 11):
            node.publish(step)
        _wait(lambda: node.persister.last_committed() == {"disk": 10}, "step 10 committed")
        assert disk.committed_steps() == [10]
        assert node.keeper.stats()["files"] == 2  # every pin was released: nothing doomed
    finally:
        node.close()
    assert _persister_threads() == []


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_two_nodes_commit_to_s3(cluster, job: str, s3_config: S3TierConfig) -> None:
    nodes = cluster(lambda name: [(S3Tier(s3_config, job), 5, 1)])
    reader = S3Tier(s3_config, job)
    _run_steps(nodes, range(1, 6), 5, [reader], ["s3"])
    assert reader.committed_steps() == [5]
    _assert_payloads(reader, nodes, 5)
    assert all(n.events.of("tier_degraded") == [] for n in nodes.values())
