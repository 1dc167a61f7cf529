"""The planner at 10,000 ranks (issue 21, item 5): its work per plan grows with the ranks
and the nodes, never with ranks x holders; a plan without corruption scans no rank for a
repair peer."""
from __future__ import annotations

import pytest

import phalanx.recovery.planner as planner
from phalanx.recovery.base import (FaultKind, FaultReport, ReplicaMap, SpareInventory,
                                   TierInventory, WorldView)
from phalanx.recovery.planner import RecoveryPolicy, plan_recovery
from phalanx.runtime.base import Generation, KeeperCopy, NodeId, Rank, SpareId, Step, WorkerId

pytestmark = pytest.mark.unit

NODES, PER_NODE, STEP = 1250, 8, Step(1000)


def job() -> tuple[WorldView, ReplicaMap]:
    """Rank r on node r mod N, its replica on node r+1 mod N, both holding two steps."""
    world_size = NODES * PER_NODE
    nodes = [NodeId(f"node{i}") for i in range(NODES)]
    workers = {Rank(r): WorkerId(f"w{r}-g0") for r in range(world_size)}
    world = WorldView(Generation(0), world_size, workers,
                      {workers[Rank(r)]: nodes[r % NODES] for r in range(world_size)},
                      frozenset(nodes), STEP)
    steps = frozenset({Step(STEP - 1), STEP})
    replicas = ReplicaMap({Rank(r): {nodes[r % NODES]: steps, nodes[(r + 1) % NODES]: steps}
                           for r in range(world_size)})
    return world, replicas


class CountingReplicas(ReplicaMap):
    calls = 0

    def steps_held(self, rank: Rank, node: NodeId) -> frozenset[Step]:
        CountingReplicas.calls += 1
        return super().steps_held(rank, node)


@pytest.mark.timeout(60)
def test_a_node_loss_at_10000_ranks_builds_keeper_sources_per_node_not_per_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world, replicas = job()
    made: list[NodeId] = []

    class CountingCopy(KeeperCopy):
        def __init__(self, node: NodeId, host: str = "", port: int = 0) -> None:
            made.append(node)
            super().__init__(node, host, port)

    monkeypatch.setattr(planner, "KeeperCopy", CountingCopy)
    lost = NodeId("node3")
    fault = FaultReport(FaultKind.NODE_DIED, world.ranks_on(lost), lost, 1.0, "node3 lost")
    spares = SpareInventory({SpareId(f"spare{i}"): NodeId(f"node{10 + i}") for i in range(8)})
    plan = plan_recovery([fault], world, CountingReplicas(replicas.holdings),
                         TierInventory({"disk": (Step(900),)}), spares, RecoveryPolicy(), 0.0)
    assert plan.restore_step == STEP and not plan.aborted
    assert len(plan.sources) == NODES * PER_NODE
    # every rank's ladder: its own keeper (or, for node3's ranks, their replica keeper
    # node4) first, then the other healthy holder, then the disk tier
    first = plan.sources[Rank(3)][0]
    assert isinstance(first, KeeperCopy) and first.node == "node4"
    ladder = plan.sources[Rank(5)]
    assert [getattr(s, "node", None) for s in ladder] == ["node5", "node6", None]
    assert getattr(ladder[2], "tier", None) == "disk"
    # a ladder per rank, but one KeeperCopy per holder node (not ~4 per rank: 40,000)
    assert len(made) <= NODES, f"{len(made)} KeeperCopy values built for {NODES} nodes"
    # no corruption reported: no rank is scanned for a repair peer
    assert CountingReplicas.calls == 0
