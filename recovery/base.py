"""Recovery's value types: fault reports, the world and inventories the planner reads, and
the recovery plan it returns (a closed union of actions, published to etcd as JSON).

Every type here is a frozen value; mappings are read-only by convention (build them from
dicts, change them with ``dataclasses.replace``). Nothing here performs I/O.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any, TypeAlias, TypeVar

from phalanx.configs.errors import FatalError
from phalanx.runtime.base import (Generation, NodeId, Rank, RestoreSource, SpareId, Step, WorkerId,
                                  source_from_json, source_to_json)

PLAN_FORMAT = 1
# Persistent tiers in the order the recovery ladder tries them; other names sort after.
TIER_ORDER: tuple[str, ...] = ("disk", "s3")


class InvalidTransition(FatalError):
    """The coordinator asked for a phase change the transitions table forbids (a bug)."""

    def __init__(self, from_phase: str, to_phase: str, reason: str = "") -> None:
        super().__init__(from_phase, to_phase, reason)
        self.from_phase = from_phase
        self.to_phase = to_phase
        self.reason = reason

    def __str__(self) -> str:
        return (f"phase {self.from_phase} -> {self.to_phase} is not allowed "
                f"(reason given: {self.reason or '-'}); see phalanx.recovery.phases.ALLOWED")


# --- faults -----------------------------------------------------------------------------


class FaultKind(enum.Enum):
    """What went wrong, as detection classifies it."""

    WORKER_DIED = "worker_died"
    NODE_DIED = "node_died"
    COLLECTIVE_ERROR = "collective_error"
    STALLED = "stalled"
    LEASE_LOST = "lease_lost"
    WORKER_EXCEPTION = "worker_exception"
    KEEPER_DIED = "keeper_died"
    PARTITIONED = "partitioned"
    SILENT_CORRUPTION = "silent_corruption"


@dataclass(frozen=True)
class Corruption:
    """What cross-replica verification found: the ranks' replica digests at the first
    ``step`` they disagreed, and ``verified_step``, the newest step whose digests agreed on
    every rank (each keeper holds it; the run rolls back no later than it); ``groups``
    the replica groups the digests were compared within ((): one group of every rank)."""

    step: Step
    verified_step: Step
    digests: tuple[tuple[Rank, str], ...]
    groups: tuple[tuple[Rank, ...], ...] = ()

    def peers_of(self, rank: Rank) -> frozenset[Rank] | None:
        """The ranks holding the same replicated state as ``rank`` (None: every rank)."""
        for group in self.groups:
            if rank in group:
                return frozenset(group)
        return None


@dataclass(frozen=True)
class FaultReport:
    """One classified fault: ``ranks`` it affects, ``node`` when node-scoped, the time it
    was first observed (coordinator clock) and human-readable ``evidence``."""

    kind: FaultKind
    ranks: tuple[Rank, ...]
    node: NodeId | None
    observed_at: float
    evidence: str
    corruption: Corruption | None = None      # SILENT_CORRUPTION only


# --- what the planner reads -------------------------------------------------------------


@dataclass(frozen=True)
class WorldView:
    """The job as the coordinator sees it at the fault: which worker holds each rank, where
    each worker runs, which nodes are alive, and the last globally committed step."""

    generation: Generation
    world_size: int
    rank_workers: Mapping[Rank, WorkerId]
    worker_nodes: Mapping[WorkerId, NodeId]
    live_nodes: frozenset[NodeId]
    committed_step: Step

    def node_of(self, rank: Rank) -> NodeId | None:
        """The node of ``rank``'s current worker, or None if the rank has no worker."""
        worker = self.rank_workers.get(rank)
        return None if worker is None else self.worker_nodes.get(worker)

    def rank_of(self, worker: WorkerId) -> Rank | None:
        """The rank ``worker`` holds, or None for a worker outside this generation."""
        return self._worker_ranks.get(worker)

    def ranks_on(self, node: NodeId) -> tuple[Rank, ...]:
        """The ranks whose workers run on ``node``, ascending."""
        return self._node_ranks.get(node, ())

    @cached_property
    def _worker_ranks(self) -> dict[WorkerId, Rank]:
        return {worker: rank for rank, worker in self.rank_workers.items()}

    @cached_property
    def _node_ranks(self) -> dict[NodeId, tuple[Rank, ...]]:
        index: dict[NodeId, list[Rank]] = {}
        for rank, worker in self.rank_workers.items():
            node = self.worker_nodes.get(worker)
            if node is not None:
                index.setdefault(node, []).append(rank)
        return {node: tuple(sorted(ranks)) for node, ranks in index.items()}


@dataclass(frozen=True)
class ReplicaMap:
    """Which keeper holds which steps of which rank: rank -> {keeper node -> steps held}.

    The rank's own node keeper appears here like any replica keeper; whether a holder is
    "own" is decided against ``WorldView``. Step collections are normalised to frozensets.
    """

    holdings: Mapping[Rank, Mapping[NodeId, frozenset[Step]]]

    def __post_init__(self) -> None:
        normal = {rank: {node: frozenset(steps) for node, steps in by_node.items()}
                  for rank, by_node in self.holdings.items()}
        object.__setattr__(self, "holdings", normal)

    @classmethod
    def of(cls, holdings: Mapping[int, Mapping[str, Iterable[int]]]) -> ReplicaMap:
        """Build from plain ints/strings (any iterable of steps per holder)."""
        return cls(holdings)  # type: ignore[arg-type]

    def steps_held(self, rank: Rank, node: NodeId) -> frozenset[Step]:
        """Every step of ``rank`` that ``node``'s keeper holds (empty if none)."""
        return self.holdings.get(rank, {}).get(node, frozenset())

    def newest_step(self, rank: Rank, node: NodeId) -> Step | None:
        """The newest step of ``rank`` held by ``node``'s keeper, or None."""
        steps = self.steps_held(rank, node)
        return max(steps) if steps else None

    def holders(self, rank: Rank, step: Step) -> tuple[NodeId, ...]:
        """Keeper nodes holding ``rank`` at ``step``, sorted by node id."""
        return tuple(sorted(node for node, steps in self.holdings.get(rank, {}).items()
                            if step in steps))


@dataclass(frozen=True)
class TierInventory:
    """Complete (commit-marked) steps per persistent tier: ``{"disk": (..), "s3": (..)}``."""

    complete_steps: Mapping[str, tuple[Step, ...]]

    def has(self, tier: str, step: Step) -> bool:
        return step in self._sets.get(tier, frozenset())

    def newest(self, tier: str) -> Step | None:
        steps = self.complete_steps.get(tier, ())
        return max(steps) if steps else None

    def in_order(self) -> tuple[str, ...]:
        """Tier names in ladder order: disk, s3, then any other name alphabetically."""
        known = [t for t in TIER_ORDER if t in self.complete_steps]
        return tuple(known + sorted(t for t in self.complete_steps if t not in TIER_ORDER))

    def first_holding(self, step: Step) -> str | None:
        """The first tier (ladder order) where ``step`` is complete, or None."""
        return next((t for t in self.in_order() if self.has(t, step)), None)

    @cached_property
    def _sets(self) -> dict[str, frozenset[Step]]:
        return {tier: frozenset(steps) for tier, steps in self.complete_steps.items()}


@dataclass(frozen=True)
class SpareInventory:
    """Live, idle, warmed spares: spare id -> the node it runs on; ``warming``: spares
    started (replacing promoted ones) that are still importing torch and the entrypoint."""

    spares: Mapping[SpareId, NodeId]
    warming: Mapping[SpareId, NodeId] = field(default_factory=dict)


# --- the plan: a closed union of actions -------------------------------------------------


@dataclass(frozen=True)
class PromoteSpare:
    """Give ``rank`` to the warm ``spare`` running on ``node``; ``warm`` False: a spare
    still warming up, which runs the rank once warm (sooner than a fresh worker started
    now, which would also slow it down)."""

    spare: SpareId
    rank: Rank
    node: NodeId
    warm: bool = True


@dataclass(frozen=True)
class RestartWorker:
    """Start a fresh worker actor for ``rank`` on the healthy ``node`` (no spare left)."""

    rank: Rank
    node: NodeId


@dataclass(frozen=True)
class RestoreFromKeeper:
    """``rank`` loads ``step`` from the keeper on ``node``: its own node's keeper
    (``own``: local for a survivor) or a replica keeper on another node."""

    rank: Rank
    node: NodeId
    step: Step
    own: bool


@dataclass(frozen=True)
class RestoreFromTier:
    """``rank`` loads ``step`` from the persistent ``tier`` ("disk", "s3")."""

    rank: Rank
    tier: str
    step: Step


@dataclass(frozen=True)
class RepairFromPeer:
    """``rank``'s replicated state (model, optimizer) at ``step`` comes from healthy rank
    ``peer``'s snapshot in the keeper on ``node``, after its own restore (silent
    corruption: its own state diverged from its data-parallel replicas)."""

    rank: Rank
    peer: Rank
    node: NodeId
    step: Step


@dataclass(frozen=True)
class Rollback:
    """Every rank goes back to ``step``, older than the committed step (memory lost it)."""

    step: Step
    reason: str


@dataclass(frozen=True)
class WaitForCapacity:
    """Nothing can be placed now: wait for a spare until ``deadline_s`` (planner clock),
    then plan again; the coordinator fails the job at the deadline."""

    deadline_s: float
    reason: str


@dataclass(frozen=True)
class Abort:
    """Recovery is impossible or not allowed: fail the job with ``reason``."""

    reason: str


Action: TypeAlias = (PromoteSpare | RestartWorker | RestoreFromKeeper | RestoreFromTier
                     | RepairFromPeer | Rollback | WaitForCapacity | Abort)

_ACTION_TAGS: dict[type, str] = {
    PromoteSpare: "promote_spare", RestartWorker: "restart_worker",
    RestoreFromKeeper: "restore_from_keeper", RestoreFromTier: "restore_from_tier",
    RepairFromPeer: "repair_from_peer", Rollback: "rollback",
    WaitForCapacity: "wait_for_capacity", Abort: "abort",
}
_ACTION_TYPES: dict[str, type] = {tag: cls for cls, tag in _ACTION_TAGS.items()}
A = TypeVar("A", PromoteSpare, RestartWorker, RestoreFromKeeper, RestoreFromTier,
            RepairFromPeer, Rollback, WaitForCapacity, Abort)


@dataclass(frozen=True)
class RecoveryPlan:
    """What the coordinator executes for the new ``generation``: the actions (who, what,
    from where), the step every rank resumes at, the new rank -> worker map, and each
    rank's restore ladder: the sources it tries in order (the action's choice first, then
    every other healthy holder, then the tiers). The coordinator only gives the sources
    their addresses; it decides nothing about them.

    ``to_json`` is a plain JSON form; ``from_json`` is its inverse.
    """

    generation: Generation
    restore_step: Step
    actions: tuple[Action, ...]
    rank_workers: Mapping[Rank, WorkerId] = field(default_factory=dict)
    reason: str = ""
    sources: Mapping[Rank, tuple[RestoreSource, ...]] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return any(isinstance(a, Abort) for a in self.actions)

    @property
    def waiting(self) -> bool:
        return any(isinstance(a, WaitForCapacity) for a in self.actions)

    def of_type(self, kind: type[A]) -> list[A]:
        """The actions of one type, in plan order."""
        return [a for a in self.actions if isinstance(a, kind)]

    def to_json(self) -> str:
        """Plain, compact JSON (no pickle); rank keys become strings."""
        doc = {"format": PLAN_FORMAT, "generation": self.generation,
               "restore_step": self.restore_step, "reason": self.reason,
               "rank_workers": {str(r): w for r, w in sorted(self.rank_workers.items())},
               "actions": [{"type": _ACTION_TAGS[type(a)], **asdict(a)} for a in self.actions],
               "sources": {str(r): [source_to_json(s) for s in ladder]
                           for r, ladder in sorted(self.sources.items())}}
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> RecoveryPlan:
        """Parse ``to_json`` output. Raises ValueError on a malformed or newer document."""
        try:
            doc = json.loads(text)
            if doc.get("format") != PLAN_FORMAT:
                raise ValueError(f"plan format {doc.get('format')!r}, expected {PLAN_FORMAT}")
            actions = tuple(_action_from(item) for item in doc["actions"])
            return cls(generation=Generation(int(doc["generation"])),
                       restore_step=Step(int(doc["restore_step"])), actions=actions,
                       rank_workers={Rank(int(r)): WorkerId(w)
                                     for r, w in doc["rank_workers"].items()},
                       reason=str(doc["reason"]),
                       sources={Rank(int(r)): tuple(source_from_json(s) for s in ladder)
                                for r, ladder in doc.get("sources", {}).items()})
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed recovery plan JSON: {exc!r}") from exc


def _action_from(item: dict[str, Any]) -> Action:
    body = dict(item)
    tag = body.pop("type")
    cls = _ACTION_TYPES.get(tag)
    if cls is None:
        raise ValueError(f"unknown plan action type {tag!r}")
    expected = {f.name for f in fields(cls)}
    if set(body) != expected:
        raise ValueError(f"plan action {tag!r} has fields {sorted(body)}, "
                         f"expected {sorted(expected)}")
    action: Action = cls(**body)
    return action
