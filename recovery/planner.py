"""The recovery planner, pure: faults, world, inventories, policy and ``now`` in; one
``RecoveryPlan`` out. The coordinator executes the plan; nothing here performs I/O.

Restore ladder, the same for every rank at the restore step (first source that holds it):

    own node keeper  ->  replica keeper on a healthy node  ->  disk tier  ->  s3 tier
    (process died,       (node died; spread: each rank        (step complete there)
     node alive; and      takes the least-used holder, the
     every survivor)      most constrained rank first)

Each rank's plan names its whole ladder (``RecoveryPlan.sources``): the chosen source
first, then every other healthy keeper holding the step (its own node's first), then
every tier, so a rank whose first source fails at restore time tries the next without
anyone planning again.

If some rank's committed step is in none of them, every rank rolls back to the newest step
complete in a persistent tier (``Rollback``) and the ladder runs again at that step. With
nothing committed at all (``Rollback(-1)``) every rank starts over from its initial state:
the lost ranks are placed as below and every survivor gets a fresh worker on its node. Silent
corruption caps the restore step at the newest step whose replicas agreed on every rank
(every rank rolls back; no worker is replaced), and each corrupted rank takes its
replicated state from a healthy peer's own keeper (``RepairFromPeer``). Lost
ranks are then replaced: warm spares first (off the failed node, spread over nodes), then
the ``on_exhausted`` policy: restart on the least-loaded healthy node, wait, or fail.
Cost: O(ranks + holders) for sources and O(lost · log nodes) for placement.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, assert_never

from phalanx.configs.schema import RecoveryConfig, SparesConfig
from phalanx.recovery.base import (Abort, Action, FaultKind, FaultReport, PromoteSpare,
                                   RecoveryPlan, RepairFromPeer, ReplicaMap, RestartWorker,
                                   RestoreFromKeeper, RestoreFromTier, Rollback, SpareInventory,
                                   TierInventory, WaitForCapacity, WorldView)
from phalanx.recovery.detection import root_cause
from phalanx.runtime.base import (Generation, KeeperCopy, NodeId, PeerCopy, Rank, RestoreSource,
                                  SpareId, Step, TierCopy, WorkerId)

# Faults whose ranks lose their worker and need a replacement.
LOSING_KINDS = frozenset({FaultKind.WORKER_DIED, FaultKind.NODE_DIED, FaultKind.PARTITIONED,
                          FaultKind.LEASE_LOST, FaultKind.WORKER_EXCEPTION, FaultKind.STALLED})
# Faults that take a whole node out of service (workers and keeper memory).
NODE_LOSS_KINDS = frozenset({FaultKind.NODE_DIED, FaultKind.PARTITIONED})
NO_STEP = Step(-1)


@dataclass(frozen=True)
class RecoveryPolicy:
    """What the planner may do, from ``spares`` and ``recovery`` config plus the run's count
    of recoveries so far. A job never shrinks: the plan union has no shrink action."""

    on_exhausted: Literal["restart", "wait", "fail"] = "restart"
    wait_timeout_s: float = 60.0
    max_recoveries: int = 20
    recoveries_so_far: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.on_exhausted not in ("restart", "wait", "fail"):
            raise ValueError(f"on_exhausted {self.on_exhausted!r}: use restart, wait or fail")
        if not self.wait_timeout_s > 0 or self.max_recoveries < 0 or self.recoveries_so_far < 0:
            raise ValueError(f"invalid recovery policy {self!r}")

    @classmethod
    def from_config(cls, spares: SparesConfig, recovery: RecoveryConfig,
                    recoveries_so_far: int = 0) -> RecoveryPolicy:
        return cls(on_exhausted=spares.on_exhausted, wait_timeout_s=spares.wait_timeout_s,
                   max_recoveries=recovery.max_recoveries,
                   recoveries_so_far=recoveries_so_far, enabled=recovery.enabled)


@dataclass(frozen=True)
class _Damage:
    """What the faults took: the lost ranks (ascending) and the nodes still fit to host a
    worker and serve memory (live, keeper alive)."""

    lost: tuple[Rank, ...]
    healthy: frozenset[NodeId]


@dataclass(frozen=True)
class _Restore:
    step: Step
    sources: list[Action]
    rollback: Rollback | None


def plan_recovery(faults: Sequence[FaultReport], world: WorldView, replicas: ReplicaMap,
                  tiers: TierInventory, spares: SpareInventory, cfg: RecoveryPolicy,
                  now: float) -> RecoveryPlan:
    """Plan the next generation. Never raises for an unrecoverable situation: the plan then
    holds one ``Abort`` (or one ``WaitForCapacity``) with the reason. Raises ValueError when
    ``faults`` is empty (there is nothing to recover from)."""
    if not faults:
        raise ValueError("plan_recovery needs at least one fault report")
    generation = Generation(world.generation + 1)
    headline = _describe(root_cause(faults))
    damage = _assess(faults, world)
    lost = set(damage.lost)
    survivors = {r: w for r, w in world.rank_workers.items() if r not in lost}

    def stop(why: str) -> RecoveryPlan:
        reason = f"{headline}; {why}"
        return RecoveryPlan(generation, world.committed_step, (Abort(reason),), survivors, reason)

    if not cfg.enabled:
        return stop("recovery is disabled (recovery.enabled: false)")
    if cfg.recoveries_so_far >= cfg.max_recoveries:
        return stop(f"recovery.max_recoveries={cfg.max_recoveries} already used; "
                    "raise it or fix the recurring fault")
    restore = _choose_restore(_verified(world, faults), damage, replicas, tiers)
    if isinstance(restore, str):
        return stop(restore)
    repairs = [] if restore.rollback else _repairs(faults, world, damage, replicas, restore.step)
    promoted, unplaced = _assign_spares(damage, spares, world)
    placements: list[PromoteSpare | RestartWorker] = list(promoted)
    if unplaced and cfg.on_exhausted == "wait":
        reason = (f"{headline}; no spare for rank(s) {_ranks_text(unplaced)}: waiting up to "
                  f"{cfg.wait_timeout_s} s for capacity")
        wait = WaitForCapacity(now + cfg.wait_timeout_s, reason)
        return RecoveryPlan(generation, restore.step, (wait,), survivors, reason)
    if unplaced and cfg.on_exhausted == "fail":
        return stop(f"no spare for rank(s) {_ranks_text(unplaced)} and spares.on_exhausted is "
                    "fail; add spares or use restart")
    if unplaced:      # on_exhausted: restart. A spare still warming beats a fresh worker
        warming, unplaced = _assign_spares(damage, SpareInventory(spares.warming), world,
                                           unplaced, warm=False)
        promoted += warming
        placements += warming
    if unplaced:
        restarts = _place_restarts(unplaced, promoted, damage, world)
        if restarts is None:
            return stop(f"no spare and no healthy node to restart rank(s) "
                        f"{_ranks_text(unplaced)}")
        placements += restarts
    replaced = (f"{len(damage.lost)} rank(s) replaced ({len(promoted)} spare(s), "
                f"{len(placements) - len(promoted)} restart(s))")
    if restore.step < 0:     # nothing to restore: the survivors start over too
        placements += _restart_survivors(survivors, world)
    rank_workers = dict(survivors)
    for action in placements:
        rank_workers[action.rank] = _worker_for(action, generation)
    actions: list[Action] = [restore.rollback] if restore.rollback else []
    actions += placements
    actions += restore.sources
    actions += repairs
    sources = _ladders(rank_workers, world, damage, replicas, tiers, restore, repairs)
    resume = (f"resume at step {restore.step}" if restore.step >= 0
              else f"all {world.world_size} rank(s) start over")
    reason = f"{headline}; {replaced}; {resume}"
    if repairs:
        reason += "; replicated state from peers: " + ", ".join(
            f"rank {r.rank} <- rank {r.peer}" for r in repairs)
    if restore.rollback:
        reason += f" (rolled back: {restore.rollback.reason})"
    return RecoveryPlan(generation, restore.step, tuple(actions), rank_workers, reason, sources)


def _ladders(ranks: Iterable[Rank], world: WorldView, damage: _Damage, replicas: ReplicaMap,
             tiers: TierInventory, restore: _Restore, repairs: Sequence[RepairFromPeer],
             ) -> dict[Rank, tuple[RestoreSource, ...]]:
    """Each rank's restore sources in ladder order: its chosen source, its peer repair,
    every other healthy keeper holding ``restore.step`` (own node first, then by node id),
    then every tier in ladder order. O(ranks · (holders + tiers))."""
    step = restore.step
    keeper_copies: dict[NodeId, KeeperCopy] = {}    # one value per node, not per rank

    def keeper(node: NodeId) -> KeeperCopy:
        return keeper_copies.get(node) or keeper_copies.setdefault(node, KeeperCopy(node))

    first: dict[Rank, RestoreSource] = {}
    for action in restore.sources:
        match action:
            case RestoreFromKeeper(rank=rank, node=node):
                first[rank] = keeper(node)
            case RestoreFromTier(rank=rank, tier=tier):
                first[rank] = TierCopy(tier)
            case PromoteSpare() | RestartWorker() | RepairFromPeer() | Rollback() \
                    | WaitForCapacity() | Abort():
                pass
            case _:
                assert_never(action)
    peers = {repair.rank: PeerCopy(repair.peer, repair.node) for repair in repairs}
    tier_copies = [TierCopy(tier) for tier in tiers.in_order()]
    ladders: dict[Rank, tuple[RestoreSource, ...]] = {}
    for rank in sorted(ranks):
        own = world.node_of(rank)
        holders = sorted((node != own, node) for node, steps in replicas.holdings.get(rank, {}).items()
                         if node in damage.healthy and step in steps)
        ladder: list[RestoreSource] = [first[rank]] if rank in first else []
        ladder += [peers[rank]] if rank in peers else []
        ladder += [held for _, node in holders if (held := keeper(node)) not in ladder]
        ladder += [copy for copy in tier_copies if copy not in ladder]
        ladders[rank] = tuple(ladder)
    return ladders


def _assess(faults: Sequence[FaultReport], world: WorldView) -> _Damage:
    """Lost ranks: those named by a losing fault, those on a dead node and those without a
    worker (left unplaced by an earlier plan). Healthy nodes: live, not lost, keeper alive."""
    node_down = {f.node for f in faults if f.kind in NODE_LOSS_KINDS and f.node is not None}
    keeper_down = {f.node for f in faults if f.kind is FaultKind.KEEPER_DIED and f.node}
    alive = world.live_nodes - node_down
    lost = {r for f in faults if f.kind in LOSING_KINDS for r in f.ranks}
    for rank in range(world.world_size):
        node = world.node_of(Rank(rank))
        if node is None or node not in alive:
            lost.add(Rank(rank))
    return _Damage(tuple(sorted(r for r in lost if 0 <= r < world.world_size)),
                   frozenset(alive - keeper_down))


def _choose_restore(world: WorldView, damage: _Damage, replicas: ReplicaMap,
                    tiers: TierInventory) -> _Restore | str:
    """The committed step if every rank has a source for it, else the newest complete tier
    step (a Rollback), else the reason nothing works."""
    committed = world.committed_step
    if committed < 0:
        why = "nothing committed yet: every rank restarts from its initial state"
        return _Restore(NO_STEP, [], Rollback(NO_STEP, why))
    sources, lacking = _sources_at(committed, world, damage, replicas, tiers)
    if not lacking:
        return _Restore(committed, sources, None)
    fallback = max((s for t in tiers.in_order() for s in tiers.complete_steps[t]
                    if 0 <= s <= committed), default=None)
    if fallback is None:
        return (f"committed step {committed} of rank(s) {_ranks_text(lacking)} is in no live "
                "keeper and no tier holds a complete step: cannot recover")
    sources, missing = _sources_at(fallback, world, damage, replicas, tiers)
    if missing:  # only if the tier inventory contradicts itself
        return f"tier step {fallback} lacks rank(s) {_ranks_text(missing)}"
    why = (f"committed step {committed} of rank(s) {_ranks_text(lacking)} is in no live "
           f"keeper; newest complete tier step is {fallback} ({tiers.first_holding(fallback)})")
    return _Restore(fallback, sources, Rollback(fallback, why))


def _verified(world: WorldView, faults: Sequence[FaultReport]) -> WorldView:
    """Silent corruption: restore no later than the newest step whose replicas agreed
    (anything newer may carry the corrupted rank's state, or its gradients)."""
    verified = [f.corruption.verified_step for f in faults if f.corruption is not None]
    if not verified:
        return world
    return replace(world, committed_step=Step(min(world.committed_step, *verified)))


def _repairs(faults: Sequence[FaultReport], world: WorldView, damage: _Damage,
             replicas: ReplicaMap, step: Step) -> list[RepairFromPeer]:
    """A healthy peer for each corrupted rank that keeps its worker: a rank of its replica
    group (``Corruption.groups``; every rank without groups) outside every corruption
    report whose own (healthy) node keeper holds ``step``, the least used first, then the
    lowest rank. None when no rank of its group is healthy (2 ranks, no majority): the
    rank then keeps its own state of ``step``, which agreed with its peers."""
    suspects = {r for f in faults if f.corruption is not None for r in f.ranks}
    if not suspects:        # no corruption: nothing to repair (no O(world) scan)
        return []
    corruptions = [f.corruption for f in faults if f.corruption is not None]
    lost = set(damage.lost)
    heaps: dict[frozenset[Rank] | None, list[tuple[int, Rank, NodeId]]] = {}
    repairs = []
    for rank in sorted(suspects - lost):
        peers = next((p for c in corruptions if (p := c.peers_of(rank)) is not None), None)
        if peers not in heaps:
            candidates = sorted(peers) if peers is not None else range(world.world_size)
            heaps[peers] = [(0, Rank(r), node) for r in candidates
                            if r not in suspects and r not in lost
                            and (node := world.node_of(Rank(r))) in damage.healthy
                            and step in replicas.steps_held(Rank(r), node)]
            heapq.heapify(heaps[peers])
        heap = heaps[peers]
        if not heap:
            continue
        used, peer, node = heapq.heappop(heap)
        repairs.append(RepairFromPeer(rank, peer, node, step))
        heapq.heappush(heap, (used + 1, peer, node))
    return repairs


def _sources_at(step: Step, world: WorldView, damage: _Damage, replicas: ReplicaMap,
                tiers: TierInventory) -> tuple[list[Action], list[Rank]]:
    """One restore action per rank at ``step`` (ascending by rank), or the ranks without any
    source. Ranks restoring from a replica keeper are matched to holders least-used first,
    the ranks with the fewest holders choosing first, so no one holder serves them all."""
    healthy, tier = damage.healthy, tiers.first_holding(step)
    chosen: dict[Rank, Action] = {}
    contested: list[tuple[int, Rank, list[NodeId]]] = []
    missing: list[Rank] = []
    for r in range(world.world_size):
        rank = Rank(r)
        own, held = world.node_of(rank), replicas.holdings.get(rank, {})
        if own is not None and own in healthy and step in held.get(own, frozenset()):
            chosen[rank] = RestoreFromKeeper(rank, own, step, True)
            continue
        others = [n for n, steps in held.items() if n != own and n in healthy and step in steps]
        if others:
            contested.append((len(others), rank, others))
        elif tier is not None:
            chosen[rank] = RestoreFromTier(rank, tier, step)
        else:
            missing.append(rank)
    if missing:
        return [], missing
    served: Counter[NodeId] = Counter()
    for _, rank, others in sorted(contested, key=lambda c: (c[0], c[1])):
        holder = min(others, key=lambda n: (served[n], n))
        served[holder] += 1
        chosen[rank] = RestoreFromKeeper(rank, holder, step, False)
    return [chosen[r] for r in sorted(chosen)], []


def _assign_spares(damage: _Damage, spares: SpareInventory, world: WorldView,
                   ranks: Sequence[Rank] | None = None,
                   warm: bool = True) -> tuple[list[PromoteSpare], list[Rank]]:
    """Spares for lost ranks (``ranks``, default every lost one) in rank order: the node
    with the fewest spares used so far, avoiding the rank's failed node when another node
    has a spare; ties by node id, then spare id. Returns the promotions and the ranks left
    without a spare."""
    by_node: dict[NodeId, list[SpareId]] = {}
    for spare, node in spares.spares.items():
        if node in damage.healthy:
            by_node.setdefault(node, []).append(spare)
    for ids in by_node.values():
        ids.sort(reverse=True)  # pop() yields the smallest id
    heap = [(0, node) for node in sorted(by_node)]
    promoted: list[PromoteSpare] = []
    unplaced: list[Rank] = []
    for rank in damage.lost if ranks is None else ranks:
        if not heap:
            unplaced.append(rank)
            continue
        used, node = _pop_avoiding(heap, world.node_of(rank), same_key_only=False)
        promoted.append(PromoteSpare(by_node[node].pop(), rank, node, warm))
        if by_node[node]:
            heapq.heappush(heap, (used + 1, node))
    return promoted, unplaced


def _place_restarts(ranks: Iterable[Rank], promoted: Sequence[PromoteSpare], damage: _Damage,
                    world: WorldView) -> list[RestartWorker] | None:
    """Fresh workers on the least-loaded healthy nodes (load = surviving ranks plus those
    placed by this plan); on a tie, not the rank's failed node. None without any node."""
    if not damage.healthy:
        return None
    lost = set(damage.lost)
    load: Counter[NodeId] = Counter({node: 0 for node in damage.healthy})
    for rank, worker in world.rank_workers.items():
        node = world.worker_nodes.get(worker)
        if rank not in lost and node is not None and node in damage.healthy:
            load[node] += 1
    for promotion in promoted:
        load[promotion.node] += 1
    heap = [(count, node) for node, count in load.items()]
    heapq.heapify(heap)
    restarts: list[RestartWorker] = []
    for rank in ranks:
        count, node = _pop_avoiding(heap, world.node_of(rank), same_key_only=True)
        restarts.append(RestartWorker(rank, node))
        heapq.heappush(heap, (count + 1, node))
    return restarts


def _pop_avoiding(heap: list[tuple[int, NodeId]], avoid: NodeId | None,
                  same_key_only: bool) -> tuple[int, NodeId]:
    """Pop the smallest entry, but take the next one instead when the smallest is on
    ``avoid`` (and, with ``same_key_only``, the next is just as small); the skipped entry
    goes back on the heap."""
    first = heapq.heappop(heap)
    if first[1] != avoid or not heap or (same_key_only and heap[0][0] != first[0]):
        return first
    second = heapq.heappop(heap)
    heapq.heappush(heap, first)
    return second


def _restart_survivors(survivors: dict[Rank, WorkerId],
                       world: WorldView) -> list[RestartWorker]:
    """A fresh worker on its own node for every surviving rank, when no step is committed:
    each rank runs its entrypoint again from its initial state, so the whole world starts
    over together (a survivor's process is past that state and cannot rewind to it)."""
    return [RestartWorker(rank, node) for rank in sorted(survivors)
            if (node := world.node_of(rank)) is not None]


def _worker_for(action: PromoteSpare | RestartWorker, generation: Generation) -> WorkerId:
    """The worker id that will hold the rank: the spare's own id, or ``w<rank>-g<gen>`` for
    a fresh actor (the launcher's naming)."""
    if isinstance(action, PromoteSpare):
        return WorkerId(action.spare)
    return WorkerId(f"w{action.rank}-g{generation}")


def _describe(cause: FaultReport) -> str:
    where = f" on node {cause.node}" if cause.node else ""
    lines = cause.evidence.strip().splitlines()
    last = lines[-1][:200] if lines else ""
    return f"{cause.kind.value} of rank(s) {_ranks_text(cause.ranks)}{where} ({last})"


def _ranks_text(ranks: Sequence[Rank], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return f"[{shown}{f', … +{len(ranks) - limit}' if len(ranks) > limit else ''}]"
