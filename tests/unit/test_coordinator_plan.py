"""The coordinator executes the planner's restore ladders as they are: it gives each source
its address (a keeper's host and port, a tier's root) and leaves out what it cannot address,
but adds, drops or reorders nothing else; the worker reads back the same typed sources."""
from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.configs.loader import load_config
from phalanx.launcher.coordination.coordinator import RecoveryCoordinator
from phalanx.launcher.events import EventLog
from phalanx.recovery.base import RecoveryPlan
from phalanx.runtime.base import (Generation, KeeperCopy, NodeId, PeerCopy, Rank, Step, TierCopy,
                                  WorkerId)
from phalanx.runtime.membership.generation import PLAN_CODEC, GenerationPlan
from tests.fakes.membership_memory import InMemoryMembership

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def coordinator(tmp_path: Path, *overrides: str) -> RecoveryCoordinator:
    cfg = load_config("configs/demo.yaml", ["job.world_size=2", *overrides])
    keepers = {0: (None, ("10.0.0.1", 7000)), 1: (None, ("10.0.0.2", 7001))}
    return RecoveryCoordinator(cfg, InMemoryMembership(), keepers, None,
                               lambda slot, gen, restore: None,
                               EventLog(tmp_path / "events.jsonl"), str(tmp_path))


def plan(sources: dict[int, tuple]) -> RecoveryPlan:
    return RecoveryPlan(Generation(2), Step(7), (), {Rank(r): WorkerId(f"w{r}") for r in sources},
                        "test", {Rank(r): s for r, s in sources.items()})


def test_sources_get_addresses_in_the_planners_order(tmp_path: Path) -> None:
    coord = coordinator(tmp_path, "tiers.s3.enabled=false")
    ladder = (KeeperCopy(NodeId("node1")), PeerCopy(Rank(0), NodeId("node0")),
              KeeperCopy(NodeId("node0")), TierCopy("s3"), TierCopy("disk"))
    worker = coord.worker_plan(plan({1: ladder, 0: (KeeperCopy(NodeId("node0")),)}))
    got = worker.ranks[1].sources
    assert got == (KeeperCopy(NodeId("node1"), "10.0.0.2", 7001),
                   PeerCopy(Rank(0), NodeId("node0"),
                            tuple(coord.cfg.detection.replicated_state), "10.0.0.1", 7000),
                   KeeperCopy(NodeId("node0"), "10.0.0.1", 7000),
                   TierCopy("disk", str(tmp_path / "checkpoints")))   # s3 is off: left out
    assert worker.ranks[0].sources == (KeeperCopy(NodeId("node0"), "10.0.0.1", 7000),)
    again = GenerationPlan.decode(worker.encode())
    assert again.ranks[1].sources == got
    assert [type(s) for s in again.ranks[1].sources] == [type(s) for s in got]


def test_the_plan_in_etcd_is_compressed_and_anything_else_is_refused(tmp_path: Path) -> None:
    coord = coordinator(tmp_path, "tiers.s3.enabled=false")
    ladder = (KeeperCopy(NodeId("node1")), KeeperCopy(NodeId("node0")), TierCopy("disk"))
    worker = coord.worker_plan(plan({r: ladder for r in range(256)}))
    encoded = worker.encode()
    assert encoded.startswith(PLAN_CODEC) and len(encoded) * 8 < len(worker.to_json())
    assert GenerationPlan.decode(encoded) == worker
    for bad in (worker.to_json(), PLAN_CODEC + b"not zlib", b""):
        with pytest.raises(ValueError, match="plan value"):
            GenerationPlan.decode(bad)


def test_a_keeper_the_launcher_does_not_know_is_left_out(tmp_path: Path) -> None:
    coord = coordinator(tmp_path, "tiers.disk.enabled=false")
    worker = coord.worker_plan(plan({0: (KeeperCopy(NodeId("node5")),
                                         KeeperCopy(NodeId("node0")))}))
    assert worker.ranks[0].sources == (KeeperCopy(NodeId("node0"), "10.0.0.1", 7000),)


def test_a_generation_heals_from_peers_unless_told_not_or_nothing_is_left(
        tmp_path: Path) -> None:
    from phalanx.recovery.base import PromoteSpare, RepairFromPeer
    from phalanx.runtime.base import SpareId
    coord = coordinator(tmp_path)
    one_lost = RecoveryPlan(Generation(2), Step(7), (PromoteSpare(SpareId("s0"), Rank(1),
                                                                  NodeId("node0")),),
                            {Rank(0): WorkerId("w0"), Rank(1): WorkerId("s0")}, "test", {})
    worker = coord.worker_plan(one_lost)
    assert worker.heal and GenerationPlan.decode(worker.encode()).heal
    everyone = RecoveryPlan(Generation(2), Step(7), tuple(
        PromoteSpare(SpareId(f"s{r}"), Rank(r), NodeId("node0")) for r in (0, 1)),
        {Rank(0): WorkerId("s0"), Rank(1): WorkerId("s1")}, "test", {})
    assert not coord.worker_plan(everyone).heal          # no survivor holds anything
    repair = RecoveryPlan(Generation(2), Step(7), (RepairFromPeer(Rank(1), Rank(0),
                                                                  NodeId("node0"), Step(7)),),
                          {Rank(0): WorkerId("w0"), Rank(1): WorkerId("w1")}, "test", {})
    assert not coord.worker_plan(repair).heal            # corruption: back to a verified step
    off = coordinator(tmp_path, "recovery.heal_from_peers=false")
    assert not off.worker_plan(one_lost).heal
