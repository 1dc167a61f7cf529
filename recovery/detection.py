"""Fault detection, pure: raw observations (signals) in, classified ``FaultReport``s out.

``classify`` turns one poll's signals into deduplicated reports (a node's death absorbs its
workers' deaths); ``StallDetector`` finds hung ranks from progress samples on a manual
clock; ``root_cause`` names the fault that explains the others. No I/O, no clock reads.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeAlias, TypeVar, assert_never

from phalanx.configs.schema import DetectionConfig
from phalanx.recovery.base import Corruption, FaultKind, FaultReport, WorldView
from phalanx.runtime.base import NodeId, Rank, Step, WorkerId

# --- signals: what the coordinator observed, before interpretation ------------------------


@dataclass(frozen=True)
class ActorDied:
    """Ray reported a worker actor dead."""

    worker_id: WorkerId
    observed_at: float
    detail: str = ""


@dataclass(frozen=True)
class NodeLost:
    """Ray (or the operator) reported a node gone."""

    node: NodeId
    observed_at: float


@dataclass(frozen=True)
class KeeperLeaseExpired:
    """The node keeper's etcd lease (the node's liveness) expired."""

    node: NodeId
    observed_at: float


@dataclass(frozen=True)
class CollectiveError:
    """A rank's collective failed (peer reset, timeout); usually a consequence."""

    reporting_rank: Rank
    observed_at: float
    detail: str = ""
    generation: int = -1      # the generation whose group failed (-1: unknown)


@dataclass(frozen=True)
class Progress:
    """A rank finished ``step`` (as its member record said); feeds ``StallDetector``.

    ``in_step``: the training thread was inside ``session.step()`` (or had just left it);
    ``busy``: it declared long work (``session.busy()``); ``step_s``: the wall time of the
    rank's last completed step (0: none yet). Defaults judge the rank as stepping."""

    rank: Rank
    step: Step
    observed_at: float
    in_step: bool = True
    busy: bool = False
    step_s: float = 0.0


@dataclass(frozen=True)
class LeaseLost:
    """A worker's membership lease expired (the observation, not the error of that name)."""

    worker_id: WorkerId
    observed_at: float


@dataclass(frozen=True)
class WorkerRaised:
    """A worker's entrypoint raised; ``traceback`` is the worker's formatted traceback."""

    rank: Rank
    traceback: str
    observed_at: float


@dataclass(frozen=True)
class SilentCorruption:
    """Every rank found (in-band, ``detection.compare_replicas``) that the replica digests of
    ``step`` differ across ranks; ``digests`` (rank, digest) as each rank published its
    own, ``verified_step`` the newest step that agreed, ``generation`` the one it ran in,
    ``groups`` the replica groups digests are compared within (ranks ascending; (): one
    group of every rank)."""

    step: Step
    verified_step: Step
    digests: tuple[tuple[Rank, str], ...]
    generation: int
    observed_at: float
    groups: tuple[tuple[Rank, ...], ...] = ()


Signal: TypeAlias = (ActorDied | NodeLost | KeeperLeaseExpired | CollectiveError | Progress
                     | LeaseLost | WorkerRaised | SilentCorruption)

# Kinds that explain a collective error in a survivor (the peer it talked to is gone).
CONSEQUENCE_KINDS = frozenset({FaultKind.COLLECTIVE_ERROR})
# Per-rank kinds a dead or partitioned node absorbs (its exception, if any, stays).
_ABSORBED_BY_NODE = frozenset({FaultKind.WORKER_DIED, FaultKind.LEASE_LOST,
                               FaultKind.COLLECTIVE_ERROR, FaultKind.STALLED})
_KIND_ORDER = {kind: i for i, kind in enumerate(FaultKind)}


def report_order(report: FaultReport) -> tuple[float, int, tuple[Rank, ...], str]:
    """Sort key: earliest first, then kind, ranks and node, so ties are deterministic."""
    return (report.observed_at, _KIND_ORDER[report.kind], report.ranks, report.node or "")


def root_cause(reports: Sequence[FaultReport]) -> FaultReport:
    """The earliest report that is not a mere consequence (a collective error is one when a
    death, stall or exception is also reported); the earliest collective error otherwise.
    Raises ValueError for an empty sequence."""
    if not reports:
        raise ValueError("root_cause needs at least one fault report")
    causes = [r for r in reports if r.kind not in CONSEQUENCE_KINDS]
    return min(causes or reports, key=report_order)


K = TypeVar("K", Rank, NodeId)


class _Earliest(Generic[K]):
    """(kind, rank or node) -> the earliest observation and its evidence: the dedupe table."""

    def __init__(self) -> None:
        self.seen: dict[tuple[FaultKind, K], tuple[float, str]] = {}

    def add(self, kind: FaultKind, key: K, at: float, evidence: str) -> None:
        old = self.seen.get((kind, key))
        if old is None or at < old[0]:
            self.seen[(kind, key)] = (at, evidence)


def classify(signals: Sequence[Signal], world: WorldView, now: float) -> list[FaultReport]:
    """Classify one poll's signals against ``world``; reports sorted earliest first.

    Rules: repeated signals collapse to one report (earliest time kept); a node that is
    lost (or whose keeper lease expired while the node is not live) yields one NODE_DIED
    listing its ranks and absorbs its workers' deaths, lease losses, stalls and collective
    errors; a keeper lease expiry on a live node is KEEPER_DIED, or PARTITIONED when workers
    on that node lost their leases too. Signals about workers or ranks outside ``world``
    (older generations, spares) are ignored. ``Progress`` is ignored here (feed it to
    ``StallDetector``). A ``SilentCorruption`` of the current generation becomes one
    SILENT_CORRUPTION report per step naming the ranks outside the digest majority (one of
    an older generation is dropped: a rollback already answered it). A signal stamped
    after ``now`` is taken as observed at ``now``.
    """
    ranks: _Earliest[Rank] = _Earliest()
    nodes: _Earliest[NodeId] = _Earliest()
    keeper_expired: dict[NodeId, float] = {}
    corrupted: dict[Step, FaultReport] = {}
    for signal in signals:
        at = min(signal.observed_at, now)
        match signal:
            case ActorDied(worker_id=worker, detail=detail):
                _add_worker(ranks, world, worker, FaultKind.WORKER_DIED, at,
                            f"actor {worker} died" + (f": {detail}" if detail else ""))
            case LeaseLost(worker_id=worker):
                _add_worker(ranks, world, worker, FaultKind.LEASE_LOST, at,
                            f"member lease of {worker} expired")
            case CollectiveError(reporting_rank=rank, detail=detail):
                if rank in world.rank_workers:
                    ranks.add(FaultKind.COLLECTIVE_ERROR, rank, at,
                              f"rank {rank} collective failed: {detail or 'no detail'}")
            case WorkerRaised(rank=rank, traceback=text):
                if rank in world.rank_workers:
                    ranks.add(FaultKind.WORKER_EXCEPTION, rank, at, text.strip())
            case NodeLost(node=node):
                nodes.add(FaultKind.NODE_DIED, node, at, f"node {node} lost")
            case KeeperLeaseExpired(node=node):
                keeper_expired[node] = min(at, keeper_expired.get(node, at))
            case SilentCorruption(generation=generation, step=step):
                if generation >= world.generation and step not in corrupted:
                    corrupted[step] = corruption_report(signal, at)
            case Progress():
                pass
            case _:
                assert_never(signal)
    _classify_keepers(keeper_expired, ranks, nodes, world)
    _add_unlive_nodes(ranks, nodes, world)
    return sorted([*_reports(ranks, nodes, world), *corrupted.values()], key=report_order)


def compare_digests(digests: Mapping[Rank, str]) -> tuple[str | None, tuple[Rank, ...]]:
    """(the digest a strict majority of ranks holds, the ranks that differ from it); with
    no strict majority (2 ranks, 1 against 1): (None, every rank), since any could be the
    corrupted one. Ranks ascending; (None, ()) for no digests."""
    if not digests:
        return None, ()
    digest, count = Counter(digests.values()).most_common(1)[0]
    if 2 * count <= len(digests):
        return None, tuple(sorted(digests))
    return digest, tuple(sorted(r for r, d in digests.items() if d != digest))


def corruption_report(signal: SilentCorruption, at: float) -> FaultReport:
    """The SILENT_CORRUPTION report of ``signal``: the ranks outside their replica group's
    majority (each group votes alone: groups hold different state)."""
    digests = dict(signal.digests)
    ranks: list[Rank] = []
    majorities: list[str] = []
    for group in signal.groups or (tuple(sorted(digests)),):
        majority, differ = compare_digests({r: digests[r] for r in group if r in digests})
        if differ:
            ranks.extend(differ)
            majorities.append(majority or "none")
    ranks.sort()
    differing = ", ".join(f"rank {r}: {d}" for r, d in signal.digests if r in ranks)
    evidence = (f"replica digests of step {signal.step} differ ({differing}; majority "
                f"{', '.join(majorities) or 'none'}); newest agreeing step "
                f"{signal.verified_step}")
    return FaultReport(FaultKind.SILENT_CORRUPTION, tuple(ranks), None, at, evidence,
                       Corruption(signal.step, signal.verified_step, signal.digests,
                                  signal.groups))


def _add_worker(table: _Earliest[Rank], world: WorldView, worker: WorkerId, kind: FaultKind,
                at: float, evidence: str) -> None:
    rank = world.rank_of(worker)
    if rank is not None:
        table.add(kind, rank, at, evidence)


def _classify_keepers(expired: dict[NodeId, float], ranks: _Earliest[Rank],
                      nodes: _Earliest[NodeId],
                      world: WorldView) -> None:
    """Keeper lease expiry: dead node, partitioned node, or just the keeper gone."""
    lease_lost_nodes = {world.node_of(rank) for kind, rank in ranks.seen
                        if kind is FaultKind.LEASE_LOST}
    for node, at in expired.items():
        if node not in world.live_nodes or (FaultKind.NODE_DIED, node) in nodes.seen:
            nodes.add(FaultKind.NODE_DIED, node, at, f"keeper lease of {node} expired, "
                      "node not live")
        elif node in lease_lost_nodes:
            nodes.add(FaultKind.PARTITIONED, node, at, f"keeper and member leases on {node} "
                      "expired while the node is live: cut off from etcd")
        else:
            nodes.add(FaultKind.KEEPER_DIED, node, at, f"keeper lease of {node} expired "
                      "while the node is live")


def _add_unlive_nodes(ranks: _Earliest[Rank], nodes: _Earliest[NodeId],
                      world: WorldView) -> None:
    """A rank fault on a node the world no longer counts live is that node's death."""
    for kind, rank in list(ranks.seen):
        node = world.node_of(rank)
        if node is not None and node not in world.live_nodes and kind in _ABSORBED_BY_NODE:
            at, _ = ranks.seen[(kind, rank)]
            nodes.add(FaultKind.NODE_DIED, node, at, f"node {node} is not live")


def _reports(ranks: _Earliest[Rank], nodes: _Earliest[NodeId],
             world: WorldView) -> Iterable[FaultReport]:
    """Per-rank reports not absorbed by a gone node, then one report per node whose time is
    its first sign (a worker on it may have been seen dying before the node was)."""
    gone = {node for kind, node in nodes.seen
            if kind in (FaultKind.NODE_DIED, FaultKind.PARTITIONED)}
    first_sign: dict[NodeId, float] = {}
    for (kind, rank), (at, evidence) in ranks.seen.items():
        node = world.node_of(rank)
        if node is not None and node in gone and kind in _ABSORBED_BY_NODE:
            first_sign[node] = min(at, first_sign.get(node, at))
            continue
        yield FaultReport(kind, (rank,), node, at, evidence)
    for (kind, node), (at, evidence) in nodes.seen.items():
        yield FaultReport(kind, world.ranks_on(node), node, min(at, first_sign.get(node, at)),
                          evidence)


# --- stalls -------------------------------------------------------------------------------


# A rank is hung only after this many of the job's longest recent step times without
# progress (or stall_timeout_s, whichever is longer): healthy steps vary (a slow batch, a
# snapshot, a busy host), rarely by 3x, while a real hang never ends; with steps much
# shorter than stall_timeout_s the timeout alone decides, so hangs are found as fast.
STALL_STEP_FACTOR = 3.0
# How many reported step times (across ranks) "recent" spans: long enough to remember one
# slow step, short enough that a slow warm-up step stops counting soon after.
RECENT_STEPS = 20


class StallDetector:
    """Finds ranks whose step stopped advancing, from progress samples on a manual clock.

    A rank is stalled once ``threshold_s()`` has passed since it reached its current step
    (``now - reached_at >= threshold_s()``) and no other rank is behind it: ranks ahead of
    a laggard are waiting for it, so only the laggards are reported. When every rank is stuck
    at one step, every rank is reported (a job-wide hang). The threshold is
    ``max(stall_timeout_s, STALL_STEP_FACTOR * longest recent step)``, the longest of the
    last ``RECENT_STEPS`` step times the ranks reported, so a job whose healthy steps are
    longer than the timeout is not taken for hung. A rank outside a step or busy
    (``Progress.in_step``/``busy``) is excused: it is never reported, nor is any rank while
    an excused one is among the laggards (the others may wait for it in a collective); its
    timer restarts when it steps again (a dead or frozen process is the lease's and the
    actor's signals to find), and no rank's wait counts from before the moment an excused
    rank was seen stepping again: a rank that waited in a collective for an evaluation pass
    is not charged for it when its next record lands a beat after the evaluator's.
    ``check`` is a pure query; only ``observe``/``forget``/``reset`` change state. Called
    from the coordinator thread only.
    """

    def __init__(self, stall_timeout_s: float) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self._step: dict[Rank, Step] = {}
        self._reached_at: dict[Rank, float] = {}
        self._excused: dict[Rank, bool] = {}
        self._step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self._excuse_ended_at = float("-inf")

    @classmethod
    def from_config(cls, cfg: DetectionConfig) -> StallDetector:
        return cls(cfg.stall_timeout_s)

    def threshold_s(self) -> float:
        """How long a rank may stay at one step before it is stalled."""
        return max(self.stall_timeout_s, STALL_STEP_FACTOR * max(self._step_times, default=0.0))

    def observe(self, sample: Progress) -> None:
        """Record a progress sample. A new step (higher, or lower after a rollback) restarts
        the rank's timer and adds its ``step_s`` to the recent step times; the same step
        again does not, unless the rank was excused and steps again; a sample older than
        the rank's current step's arrival is ignored (reordered delivery)."""
        rank, step, at = sample.rank, sample.step, sample.observed_at
        excused = sample.busy or not sample.in_step
        known = rank in self._step
        if known and at < self._reached_at[rank]:
            return
        new_step = not known or step != self._step[rank]
        resumed = known and self._excused[rank] and not excused
        if known and self._excused[rank] and (new_step or not excused):
            self._excuse_ended_at = max(self._excuse_ended_at, at)
        self._excused[rank] = excused
        if new_step and sample.step_s > 0:
            self._step_times.append(sample.step_s)
        if new_step or resumed:
            self._step[rank] = step
            self._reached_at[rank] = at

    def forget(self, rank: Rank) -> None:
        """Stop tracking ``rank`` (it was replaced; the new worker starts a fresh timer)."""
        self._step.pop(rank, None)
        self._reached_at.pop(rank, None)
        self._excused.pop(rank, None)

    def reset(self) -> None:
        """Forget every rank and the recent step times (a new generation starts)."""
        self._step.clear()
        self._reached_at.clear()
        self._excused.clear()
        self._step_times.clear()
        self._excuse_ended_at = float("-inf")

    def check(self, now: float) -> list[FaultReport]:
        """STALLED reports (one per laggard rank, ascending) as of ``now``."""
        if not self._step:
            return []
        lowest, furthest = min(self._step.values()), max(self._step.values())
        laggards = sorted(rank for rank, step in self._step.items() if step == lowest)
        if any(self._excused[rank] for rank in laggards):
            return []
        threshold = self.threshold_s()
        longest = max(self._step_times, default=0.0)
        reports = []
        for rank in laggards:
            since = max(self._reached_at[rank], self._excuse_ended_at)
            if now - since < threshold:
                continue
            reports.append(FaultReport(
                FaultKind.STALLED, (rank,), None, since + threshold,
                f"rank {rank} stayed at step {lowest} for {now - since:.3f} s (threshold "
                f"{threshold:.3f} s: stall_timeout_s={self.stall_timeout_s}, longest recent "
                f"step {longest:.3f} s x {STALL_STEP_FACTOR:g}); furthest rank at step "
                f"{furthest}"))
        return reports
