"""The synthetic job of ``bench/scale_sim.py``, pure: a world of N nodes x 8 ranks (round
robin, as the launcher places ranks), its replica placement, the keepers' reports and the
member records as phalanx writes them, the faults it plans for, and the etcd request-rate
model of today's per-rank heartbeats next to one heartbeat per node (issue 21, item 4).

The records mirror what the code writes: a member record carries the fields
``Session._record`` puts in it, a keeper report is ``report_from_keeper``'s (three local
steps per own rank and two replica steps per held rank, as a world-8 run reported), the
worker-facing plan is ``RecoveryCoordinator.worker_plan``'s with addresses filled in.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from phalanx.recovery.base import (FaultKind, FaultReport, RecoveryPlan, ReplicaMap,
                                   SpareInventory, TierInventory, WorldView)
from phalanx.recovery.planner import RecoveryPolicy
from phalanx.runtime.base import (Generation, KeeperCopy, MemberRecord, NodeId, PeerCopy, Rank,
                                  SpareId, Step, TierCopy, WorkerId, encode_member, node_name)
from phalanx.runtime.commit import KeeperReport
from phalanx.runtime.membership.generation import GenerationPlan, RankAssignment
from phalanx.runtime.replication.placement import Placement, PlacementInput, place_replicas

RANKS_PER_NODE = 8
STEP = Step(1000)               # the step every rank is at; the committed step is STEP - 1
FACTOR = 1                      # replication.factor (the default)
SPARES = 16                     # warm spares, spread over the first nodes
HEARTBEAT_S = 0.5               # etcd.heartbeat_s default
LEASE_TTL_S = 3.0               # etcd.lease_ttl_s default (keepalive every ttl / 3)
POLL_S = 0.1                    # detection.poll_interval_s default: launcher reads members
COMMIT_READ_S = 0.5             # CommitTracker.read_every_s: members + keepers again
DISK_ROOT = "/var/lib/phalanx/runs/2026-12-02T07-00-00-scale/checkpoints"


@dataclass(frozen=True)
class Job:
    """One size of the simulated job and every input the pure code reads."""

    nodes: int
    world: WorldView
    rank_nodes: dict[Rank, NodeId]
    placement: Placement
    replicas: ReplicaMap
    tiers: TierInventory
    spares: SpareInventory
    reports: dict[str, KeeperReport]

    @property
    def ranks(self) -> int:
        return self.world.world_size


def build_job(nodes: int, ranks_per_node: int = RANKS_PER_NODE) -> Job:
    """N nodes, ``ranks_per_node`` ranks each (rank r on node r mod N), every rank at STEP."""
    world_size = nodes * ranks_per_node
    names = [node_name(i) for i in range(nodes)]
    rank_nodes = {Rank(r): names[r % nodes] for r in range(world_size)}
    rank_workers = {Rank(r): WorkerId(f"w{r}-g0") for r in range(world_size)}
    world = WorldView(Generation(0), world_size, rank_workers,
                      {rank_workers[r]: n for r, n in rank_nodes.items()}, frozenset(names),
                      Step(STEP - 1))
    placement = place_replicas(PlacementInput(rank_nodes, names, FACTOR))
    steps = frozenset({Step(STEP - 1), STEP})
    replicas = ReplicaMap({r: {rank_nodes[r]: steps, **{h: steps for h in placement.holders[r]}}
                           for r in rank_nodes})
    spares = SpareInventory({SpareId(f"spare{i}"): names[(i * 7 + 1) % nodes]
                             for i in range(SPARES)})
    return Job(nodes, world, rank_nodes, placement, replicas,
               TierInventory({"disk": (Step(STEP - 100),)}), spares,
               keeper_reports(names, rank_nodes, placement))


def keeper_reports(names: list[NodeId], rank_nodes: dict[Rank, NodeId],
                   placement: Placement) -> dict[str, KeeperReport]:
    local: dict[NodeId, dict[int, tuple[int, ...]]] = {n: {} for n in names}
    held: dict[NodeId, dict[int, tuple[int, ...]]] = {n: {} for n in names}
    for rank, node in rank_nodes.items():
        local[node][rank] = (STEP - 2, STEP - 1, STEP)     # as a real keeper reported
        for holder in placement.holders[rank]:
            held[holder][rank] = (STEP - 1, STEP)
    return {n: KeeperReport(n, (keeper_host(i), 40000 + i), local[n], held[n],
                            bytes_held=(len(local[n]) + len(held[n])) * 2 * (64 << 20))
            for i, n in enumerate(names)}


def keeper_host(index: int) -> str:
    return f"10.{index // 65536}.{index // 256 % 256}.{index % 256}"


def member_value(rank: int, node: str, step: int, generation: int = 0,
                 now: float = 1.7e9) -> bytes:
    """A rank's member record as ``Session._record`` writes it at a heartbeat."""
    extra: dict[str, Any] = {
        "state": "running", "time": now, "first_step_at": now - 600.0,
        "collective_error": None, "restored": None,
        "replicas": {"diverged": None, "verified": step - 2,    # detection.compare_replicas
                     "recent": [[s, "0d2990ef181780f"] for s in range(step - 3, step + 1)]},
        "snapshot": {"every_steps": 1, "stall_s": 0.012345, "captures": step},
        "in_step": True, "busy": None, "step_s": 0.412345, "left_step_at": now - 0.1}
    return encode_member(MemberRecord(f"w{rank}-g{generation}", rank, node, "", step,
                                      generation, 100000 + rank, extra))


def node_progress_value(node: str, ranks: list[int], step: int, now: float = 1.7e9) -> bytes:
    """One node's aggregated progress (item 4's design): the keeper's record carrying each
    of its ranks' heartbeat fields. An estimate of that design's bytes, not its format."""
    per_rank = {str(r): {"w": f"w{r}-g0", "step": step, "in_step": True, "busy": None,
                         "step_s": 0.412345, "left_step_at": now - 0.1,
                         "stall_s": 0.012345, "collective_error": None} for r in ranks}
    record = MemberRecord(f"keeper.{node}", -1, node, "10.0.0.1:40000", -1, 0, 4242,
                          {"role": "keeper", "time": now, "ranks": per_rank})
    return encode_member(record)


# --- faults ------------------------------------------------------------------------------


def node_loss(job: Job, index: int = 3) -> FaultReport:
    node = node_name(index % job.nodes)
    return FaultReport(FaultKind.NODE_DIED, job.world.ranks_on(node), node, 10.0,
                       f"node {node} lost")


def worker_loss(job: Job, rank: int = 5) -> FaultReport:
    return FaultReport(FaultKind.WORKER_DIED, (Rank(rank),), job.rank_nodes[Rank(rank)], 10.0,
                       f"actor w{rank}-g0 died")


def scenarios(job: Job) -> dict[str, list[FaultReport]]:
    """The three plans timed: a node loss, a worker loss, both at once (other nodes)."""
    other = next(r for r in range(job.ranks) if job.rank_nodes[Rank(r)] != node_name(3 % job.nodes))
    return {"node_loss": [node_loss(job)], "worker_loss": [worker_loss(job, other)],
            "two_faults": [node_loss(job), worker_loss(job, other)]}


def policy() -> RecoveryPolicy:
    return RecoveryPolicy()


def worker_plan(plan: RecoveryPlan, job: Job) -> GenerationPlan:
    """What the coordinator fences into ``plan/<g>``: every rank's worker and its restore
    sources with addresses (keeper host:port, the disk tier's root)."""
    ranks = {}
    for rank, worker in plan.rank_workers.items():
        sources = []
        for source in plan.sources.get(rank, ()):
            if isinstance(source, (KeeperCopy, PeerCopy)):
                index = int(source.node.removeprefix("node"))
                sources.append(replace(source, host=keeper_host(index), port=40000 + index))
            elif isinstance(source, TierCopy):
                sources.append(TierCopy(source.tier, DISK_ROOT))
        ranks[int(rank)] = RankAssignment(str(worker), tuple(sources))
    return GenerationPlan(plan.generation, job.ranks, plan.restore_step, ranks, plan.reason,
                          ("10.0.0.1", 29500))


# --- the etcd request model --------------------------------------------------------------


@dataclass(frozen=True)
class LoadModel:
    """etcd requests per second at steady state, from the code's own rules, for ``nodes`` x
    ``ranks_per_node`` with every rank stepping faster than the heartbeat.

    ``per_node`` False: today (a lease and a member put per rank every heartbeat, plus the
    keeper's lease, report put and commit read per node); True: one lease and one put per
    node, the keeper carrying its ranks' progress (item 4)."""

    nodes: int
    ranks_per_node: int = RANKS_PER_NODE
    per_node: bool = False
    heartbeat_s: float = HEARTBEAT_S
    ttl_s: float = LEASE_TTL_S

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def leases(self) -> int:
        return self.nodes if self.per_node else self.ranks + self.nodes

    def puts_per_s(self) -> float:
        """Keys written: member records (per rank today) and keeper reports, every beat;
        the launcher's commit (~1 per 5 s) and progress event (2 per s) are per job."""
        beats = self.nodes if self.per_node else self.ranks + self.nodes
        return beats / self.heartbeat_s + 0.2 + 2.0

    def keepalives_per_s(self) -> float:
        return self.leases / (self.ttl_s / 3)

    def reads_per_s(self) -> float:
        """Range reads: each keeper reads ``commit`` every beat; the launcher lists members
        and checks its leadership every poll, and lists members + keepers every commit
        read (world 8 on 4 nodes: 32/s modelled, 42/s measured)."""
        return self.nodes / self.heartbeat_s + 2 / POLL_S + 2 / COMMIT_READ_S

    def member_lists_per_s(self) -> float:
        """How often the launcher reads the whole member table (monitor + commit tracker)."""
        return 1 / POLL_S + 1 / COMMIT_READ_S

    def as_dict(self) -> dict[str, float]:
        return {"puts_per_s": self.puts_per_s(), "keepalives_per_s": self.keepalives_per_s(),
                "reads_per_s": self.reads_per_s(), "leases": self.leases,
                "requests_per_s": self.puts_per_s() + self.keepalives_per_s()
                + self.reads_per_s()}


def recovery_writes(ranks: int, lost: int) -> dict[str, int]:
    """Keys a recovery writes today (beyond the steady beats): the fence transaction's two
    keys; every rank's ``restore/<g>/<rank>`` report (restoring, then restored) and its
    delete by the launcher; each replacement's lease and member record; the launcher's
    fault, plan, promoted and recovered events."""
    return {"fence_keys": 2, "restore_puts": 2 * ranks, "restore_deletes": ranks,
            "replacement_puts": lost, "lease_grants": lost, "event_puts": 3 + lost,
            "plan_reads": ranks}
