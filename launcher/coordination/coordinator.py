"""The recovery coordinator's executor: turns classified faults into a plan (pure planner),
then acts on it: fence the generation in etcd, publish the worker-facing plan, promote
spares or start fresh workers, kill hung ranks, and time every phase until the first step
of the new generation completes."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, assert_never

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from phalanx.configs.errors import PlanInfeasible
from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.coordination.bounds import (REJOIN_MARGIN_S, Laggard, TierListing,
                                                  laggards, not_reformed, rejoin_bound_s,
                                                  tier_inventory_bound_s)
from phalanx.launcher.coordination.retry import RETRIED, retry_transient
from phalanx.launcher.events import EventLog
from phalanx.launcher.services.leadership import FenceLost
from phalanx.runtime.base import (KeeperCopy, PeerCopy, RestoreSource, TierCopy, node_index,
                                  node_name, source_to_json)
from phalanx.recovery.base import (Abort, FaultKind, FaultReport, PromoteSpare, RecoveryPlan,
                                   RepairFromPeer, ReplicaMap, RestartWorker, RestoreFromKeeper,
                                   RestoreFromTier, Rollback, SpareInventory, TierInventory,
                                   WaitForCapacity, WorldView)
from phalanx.recovery.phases import Phase, PhaseMachine
from phalanx.recovery.planner import RecoveryPolicy, plan_recovery
from phalanx.runtime.base import (Generation, MemberRecord, Membership, Rank, SpareId, Step,
                                  WorkerId)
from phalanx.runtime.commit import KeeperReport, committed_step
from phalanx.runtime.tiers.config import build_tiers, disk_tier_root
from phalanx.runtime.membership.generation import (GENERATION_KEY, GenerationPlan, RankAssignment,
                                                   plan_key)
from phalanx.runtime.keeper.reporter import report_from_keeper
from phalanx.runtime.replication.placement import Placement, PlacementInput, place_replicas
from phalanx.runtime.worker.restore_progress import (RESTORED, read_reports,
                                                     restore_bound_s, restore_key,
                                                     stale_after_s)
from phalanx.spares.pool import SparePool

log = logging.getLogger(__name__)


@dataclass
class RankSlot:
    """Who runs a rank now: its worker id, node, Ray actor and the ref of its ``run``."""

    rank: int
    worker_id: str
    node: int
    actor: Any
    ref: Any = None
    pid: int = 0
    name: str = ""       # the actor's name in the job's Ray namespace (a standby finds it)
    local_rank: int = -1   # torchrun's LOCAL_RANK given to its process (-1: not launched)


@dataclass
class Recovery:
    """One recovery in flight, for timing and reporting."""

    generation: int
    restore_step: int
    fault_at: float
    root: FaultReport
    phases: dict[str, float] = field(default_factory=dict)
    plan_reason: str = ""
    fault_wall: float = 0.0
    lost_steps: int = 0
    phase_start: int = 0
    rejoin_by: float = float("inf")   # coordinator clock: the group re-formed by then
    rejoin_s: float = 0.0             # the bound rejoin_by was set from
    workers: dict[int, str] = field(default_factory=dict)   # rank -> its worker in the plan
    slow_restore: bool = False        # a rank's restore outlasted rejoin_by (told once)
    new_workers: frozenset[str] = frozenset()   # the spares and fresh workers it started
    workers_up_at: float | None = None  # wall clock: every one of them registered


@dataclass
class Waiting:
    """A recovery parked by ``spares.on_exhausted: wait``: the faults to recover from once
    a spare is warm again, and when to give up (coordinator clock)."""

    faults: list[FaultReport]
    deadline: float
    reason: str
    needed: int                    # warm spares the parked plan needs
    next_try: float = 0.0


Launch = Callable[[RankSlot, int, dict | None], Any]
WAIT_RETRY_S = 0.2        # how often a parked recovery looks for a warm spare
KEEPER_CALL_S = 10.0      # one keeper call's timeout (retried within the recovery's deadline)
FIRST_KEEPER_TRY_S = 2.0  # a first try: a keeper that misses it is asked whether it lives


class RecoveryCoordinator:
    """Owned by the launcher's main thread."""

    def __init__(self, cfg: PhalanxConfig, membership: Membership, keepers: dict[int, tuple[Any, tuple[str, int]]],
                 pool: SparePool | None, launch: Launch, events: EventLog,
                 run_dir: str, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cfg = cfg
        self.membership = membership
        self.keepers = keepers
        self.pool = pool
        self.launch = launch
        self.events = events
        self.run_dir = run_dir
        self.clock = clock
        self.sleep = sleep
        # raises LeadershipLost once this launcher no longer leads (the job's poll check),
        # asked between the tries of a recovery step that failed transiently
        self.still_leading: Callable[[], None] = lambda: None
        # does node i answer nothing (a dead host, a cut link)? the launcher's node watch
        self.silent: Callable[[int], bool] = lambda node: False
        self.phases = PhaseMachine(clock, on_change=lambda c: events.emit(
            "phase", **{"from": c.from_phase.value, "to": c.to_phase.value,
                        "reason": c.reason, "duration_s": round(c.duration_s, 4)}))
        self.generation = 0
        self.recoveries = 0
        self.live_nodes: set[int] = set(range(cfg.job.nodes))
        self.pending: Recovery | None = None
        self.placement: Placement | None = None
        self.committed: Callable[[], int] = lambda: -1
        self.history: list[dict[str, Any]] = []
        self.waiting: Waiting | None = None
        self.store_address: tuple[str, int] | None = None   # this launcher's TCPStore
        self.routes: dict[int, tuple[str, int]] = {}   # node -> where its replicas go (drills)
        self.holders_before: dict[int, dict[int, list[str]]] = {}  # generation -> replica holders
        # a run started with --resume: the verified checkpoint's restore (step, sources) and
        # its run id; nothing committed yet, every rank starts over from it, not from scratch
        self.resumed_from: tuple[dict[str, Any], str] | None = None

    def fence_initial(self) -> None:
        if not self.membership.compare_and_swap(GENERATION_KEY, 0, b"0"):
            raise PlanInfeasible("generation key already exists: another launcher runs this job")

    @property
    def retry_budget_s(self) -> float:
        """How long one recovery (or one placement) retries its transient failures:
        ``recovery.group_timeout_s``, well within a survivor's wait for the plan."""
        return self.cfg.recovery.group_timeout_s

    def _retry(self, op: Callable[[], Any], what: str, deadline: float) -> Any:
        return retry_transient(op, what, deadline, self.retry_budget_s, self.clock,
                               self.sleep, self.still_leading)

    def place(self, slots: Mapping[int, RankSlot], deadline: float | None = None) -> None:
        """Choose replica holders for this generation and hand every live keeper its part:
        which local ranks to replicate where (and the generation that fences older writers).
        A keeper too busy to answer is asked again until ``deadline`` (default: the retry
        budget from now); raises ``RecoveryStalled`` past it."""
        if deadline is None:
            deadline = self.clock() + self.retry_budget_s
        live = sorted(n for n in self.live_nodes if n in self.keepers)
        factor = min(self.cfg.replication.copies,
                     len(live) - 1)
        holders: dict[int, list[str]] = {}
        if factor > 0:
            placement = place_replicas(PlacementInput(
                {Rank(r): node_name(s.node) for r, s in slots.items()},
                [node_name(n) for n in live], factor), previous=self.placement)
            self.placement = placement
            holders = {int(r): list(h) for r, h in placement.holders.items()}
        addresses = {node_name(n): list(self.routes.get(n) or self.keepers[n][1]) for n in live}
        for node in live:
            def targets(node: int = node, limit_s: float = KEEPER_CALL_S) -> Any:
                return ray.get(self.keepers[node][0].set_targets.remote(
                    self.generation, [r for r, s in slots.items() if s.node == node], holders,
                    addresses), timeout=max(0.1, min(limit_s, deadline - self.clock())))
            try:
                self._call_keeper(targets, node, f"replica targets of keeper {node_name(node)}",
                                  deadline)
            except RayActorError as exc:  # detected as a node fault on the next poll
                self.events.emit("keeper_unreachable", node=node_name(node),
                                 error=str(exc).splitlines()[0][:200])
        self.events.emit("placement", generation=self.generation, factor=factor,
                         holders={str(r): h for r, h in sorted(holders.items())})

    def _call_keeper(self, call: Callable[..., Any], node: int, what: str,
                     deadline: float) -> None:
        """``call`` ``node``'s keeper: a first try within ``FIRST_KEEPER_TRY_S`` (a live
        keeper answers in milliseconds), then retries until ``deadline``. A first try that
        times out on a node that answers nothing (``silent``: neither its keeper nor its
        raylet accepts a connection; a dead host or a cut link, whose lease may not have
        lapsed yet) takes the node for lost (``node_silent``) instead of retrying it until
        the recovery stalls. ``call(limit_s=...)`` bounds one try."""
        try:
            self._first_try(call, node)
            return
        except RETRIED:
            pass
        self._retry(call, what, deadline)

    def _first_try(self, call: Callable[..., Any], node: int) -> Any:
        """``call(limit_s=FIRST_KEEPER_TRY_S)``; when it times out and ``node`` is silent,
        the node is forgotten (``node_silent``) and None returned, else the call is made
        once more with the rest of ``KEEPER_CALL_S``. Raises what ``call`` raises."""
        try:
            return call(limit_s=FIRST_KEEPER_TRY_S)
        except GetTimeoutError:
            if not self.silent(node):
                return call(limit_s=KEEPER_CALL_S - FIRST_KEEPER_TRY_S)
        log.warning("event=node_silent node=%s: its keeper's call timed out and neither its "
                    "keeper nor its raylet answers", node_name(node))
        self.events.emit("node_silent", node=node_name(node))
        self._forget_node(node_name(node))
        return None

    # -- the recovery ------------------------------------------------------------------
    def recover(self, faults: Sequence[FaultReport], slots: dict[int, RankSlot],
                *, replay: bool = False) -> None:
        """Plan and execute one recovery; raises ``PlanInfeasible`` when the plan aborts. A
        plan that must wait for capacity parks the recovery (phase DEGRADED): ``retry``
        plans it again once a spare is warm, until ``spares.wait_timeout_s``."""
        deadline = self.clock() + self.retry_budget_s
        if self.waiting is not None:       # faults while parked join the parked ones
            faults = self.waiting.faults + self.fresh(faults)
        root = min(faults, key=lambda f: f.observed_at)
        reached = self._reached(slots)
        for fault in faults:
            if not replay:             # a parked recovery planned again: known faults
                self.events.emit("fault", kind=fault.kind.value, ranks=list(fault.ranks),
                                 node=fault.node, evidence=fault.evidence)
                if fault.corruption is not None:
                    found = fault.corruption
                    self.events.emit("sdc_detected", step=found.step, ranks=list(fault.ranks),
                                     digests={str(r): d for r, d in found.digests},
                                     verified_step=found.verified_step)
            if fault.kind is FaultKind.NODE_DIED and fault.node:
                self._forget_node(fault.node)
        phase_start = len(self.phases.history)
        fault_wall = time.time() - max(0.0, self.clock() - root.observed_at)
        self.phases.transition(Phase.DETECTING, root.evidence[:80])
        detect_s = max(0.0, self.clock() - root.observed_at)
        self.phases.transition(Phase.PLANNING, "faults classified")
        reports = self._fresh_reports()
        lost_nodes = {f.node for f in faults if f.node} - {node_name(n) for n in self.live_nodes}
        faults = list(faults) + [FaultReport(FaultKind.NODE_DIED, tuple(
            Rank(r) for r, s in slots.items() if node_name(s.node) == node), node, root.observed_at,
            f"keeper of {node} is gone") for node in sorted(lost_nodes)]
        tiers = self._tiers()
        world = self._world(slots, reports, tiers)
        plan = plan_recovery(faults, world, self._replicas(reports), tiers,
                             self._spares(), RecoveryPolicy.from_config(
                                 self.cfg.spares, self.cfg.recovery, self.recoveries), time.time())
        self.events.emit("plan", generation=plan.generation, restore_step=plan.restore_step,
                         actions=[type(a).__name__ for a in plan.actions], reason=plan.reason)
        if plan.waiting and not plan.aborted:
            self._park(list(faults), plan)
            return
        if plan.aborted:
            self.phases.transition(Phase.FAILED, plan.reason)
            raise PlanInfeasible(plan.reason)
        self.waiting = None
        self.holders_before[plan.generation] = {
            int(r): list(h) for r, h in self.placement.holders.items()} if self.placement else {}
        self.phases.transition(Phase.FENCING, f"generation {plan.generation}")
        self._fence(plan, deadline)
        self.phases.transition(Phase.PROMOTING, "plan published")
        self._promote(plan, slots, faults)
        self.place(slots, deadline)
        self.phases.transition(Phase.RESTORING, "workers started")
        self.recoveries += 1
        newest = max([plan.restore_step, *(max(steps) for report in reports.values()
                                           for steps in report.local.values() if steps),
                      *reached])
        bound = rejoin_bound_s(self.cfg.recovery.group_timeout_s, self.cfg.etcd.heartbeat_s,
                               any(isinstance(a, RestartWorker) or (isinstance(
                                   a, PromoteSpare) and not a.warm) for a in plan.actions))
        restore_step = plan.restore_step if plan.restore_step >= 0 or not self.resumed_from \
            else int(self.resumed_from[0]["step"])          # restarted from the resume point
        self.pending = Recovery(plan.generation, restore_step, root.observed_at, root,
                                {"detect": detect_s}, plan.reason, fault_wall,
                                max(0, newest - restore_step), phase_start,
                                self.clock() + bound, bound,
                                {r: s.worker_id for r, s in slots.items()},
                                new_workers=frozenset(
                                    slots[a.rank].worker_id for a in plan.actions
                                    if isinstance(a, (PromoteSpare, RestartWorker))))

    def check_rejoined(self, members: Mapping[str, MemberRecord],
                       finished: set[int],
                       last_seen: Mapping[str, MemberRecord] | None = None,
                       sessionless: bool = False) -> None:
        """Called every poll: past the pending recovery's bound, a generation some rank
        never joined fails the job (``GroupNotReformed``, event ``recovery_stalled``) rather
        than leaving its ranks waiting minutes for a plan that will not come. A rank of the
        plan that has returned from its entrypoint fails it at once, unless every rank of
        the plan returned after joining the generation (``last_seen``: each worker's last
        member record): the fault struck after the last step (an evaluation after the
        last epoch, which the ranks then ran again together) and the recovery is complete
        without a step.

        ``sessionless``: no rank has run a Session in this job (an unmodified torchrun
        script): every rank was restarted from the top of its script, which forms the
        new generation's group in its own ``init_process_group()`` and reports no step.
        The recovery is done once the restarted workers run (torchrun's
        ``--max-restarts``); a group that does not form fails in the script itself."""
        pending = self.pending
        if pending is None:
            return
        if pending.workers_up_at is None:
            pending.workers_up_at = _workers_up_at(pending, members)
        if sessionless:
            self._complete(pending, time.time(), pending.restore_step, healed=False,
                           restarted=True)
            return
        gone = finished & set(pending.workers)
        if gone == set(pending.workers) and self._all_joined(pending, members, last_seen):
            self._complete(pending, time.time(), pending.restore_step + pending.lost_steps,
                           healed=True)
            return
        if not gone and self.clock() < pending.rejoin_by:
            return
        behind = laggards(pending.generation, pending.workers, members, gone)
        if gone:        # the others wait for the finished ranks: name only those
            behind = [lag for lag in behind if lag.rank in gone]
        if not gone and not behind:
            return          # joined; the first step (however long) is the stall detector's
        if not gone and self._still_restoring(pending, behind):
            return          # a slow restore that still reports progress: waited for
        bound = restore_bound_s(self.cfg.recovery.group_timeout_s) if pending.slow_restore \
            else pending.rejoin_s
        self.events.emit("recovery_stalled", generation=pending.generation, bound_s=bound,
                         ranks={str(lag.rank): lag.why for lag in behind})
        self.phases.transition(Phase.FAILED, f"generation {pending.generation} not re-formed")
        raise not_reformed(pending.generation, bound, self.cfg.recovery.group_timeout_s, behind)

    def _all_joined(self, pending: Recovery, members: Mapping[str, MemberRecord],
                    last_seen: Mapping[str, MemberRecord] | None) -> bool:
        """Whether every rank of the pending generation joined it: its last record seen
        names the generation, or it reported its restore there (a heal restores after the
        group formed; a rank that returns at once leaves no record the launcher saw)."""
        seen = {**(last_seen or {}), **members}
        try:
            reports = read_reports(self.membership, pending.generation)
        except Exception as exc:  # etcd unreachable: the records alone
            log.warning("event=restore_reports_unreadable error=%r", exc)
            reports = {}
        for rank, worker in pending.workers.items():
            record, report = seen.get(worker), reports.get(rank)
            if not ((record is not None and record.generation >= pending.generation)
                    or (report is not None and report.worker == worker
                        and report.state == RESTORED)):
                return False
        return True

    def _still_restoring(self, pending: Recovery, behind: Sequence[Laggard]) -> bool:
        """Whether every rank ``behind`` still reports its restore (or has just restored
        and is forming its group), within ``restore_bound_s`` of the plan: the
        generation waits for them (event ``restore_slow``, once) instead of failing."""
        gt = self.cfg.recovery.group_timeout_s
        if self.clock() > pending.rejoin_by - pending.rejoin_s + restore_bound_s(gt):
            return False
        try:
            reports = read_reports(self.membership, pending.generation)
        except Exception as exc:  # etcd unreachable: no evidence of progress
            log.warning("event=restore_reports_unreadable error=%r", exc)
            return False
        now, stale = time.time(), stale_after_s(self.cfg.etcd.heartbeat_s)
        slow = {lag.rank: reports[lag.rank] for lag in behind if lag.rank in reports
                and reports[lag.rank].worker == lag.worker_id
                and (reports[lag.rank].in_progress(now, stale)
                     or reports[lag.rank].formed_within(now, gt + REJOIN_MARGIN_S))}
        if len(slow) < len(behind):
            return False
        if not pending.slow_restore:
            pending.slow_restore = True
            self.events.emit("restore_slow", generation=pending.generation,
                             bound_s=restore_bound_s(gt),
                             ranks={str(r): round(now - rep.started, 1)
                                    for r, rep in sorted(slow.items())})
        return True

    def _reached(self, slots: Mapping[int, RankSlot]) -> list[int]:
        """The steps the ranks had completed when the fault struck (their member records):
        what a rollback makes them compute again, snapshotted or not."""
        workers = {slot.worker_id for slot in slots.values()}
        try:
            members = self.membership.members()
        except Exception as exc:  # etcd unreachable: the keepers' newest steps must do
            log.warning("event=members_unreadable error=%r", exc)
            return []
        return [m.step for m in members.values() if m.rank >= 0 and m.worker_id in workers]

    def _park(self, faults: list[FaultReport], plan: RecoveryPlan) -> None:
        needed = len({rank for fault in faults for rank in fault.ranks})
        if self.waiting is None:
            wait = next(a for a in plan.actions if isinstance(a, WaitForCapacity))
            self.waiting = Waiting(faults, self.clock() + max(0.0, wait.deadline_s - time.time()),
                                   plan.reason, needed)
            self.events.emit("waiting_for_capacity", reason=plan.reason, spares_needed=needed,
                             wait_timeout_s=self.cfg.spares.wait_timeout_s)
        self.waiting.faults, self.waiting.needed = faults, needed
        self.waiting.next_try = self.clock() + WAIT_RETRY_S
        self.phases.transition(Phase.DEGRADED, plan.reason)
        if self.pool is not None:      # replacements start as the cluster has room
            self.pool.refill(sorted(self.live_nodes), at_least=needed)

    def fresh(self, faults: Sequence[FaultReport]) -> list[FaultReport]:
        """``faults`` less those a parked recovery already covers: a dead worker is observed
        again at every poll until its rank is placed, and later as a lost lease too."""
        if self.waiting is None:
            return list(faults)
        ranks = {rank for fault in self.waiting.faults for rank in fault.ranks}
        nodes = {f.node for f in self.waiting.faults if f.kind is FaultKind.NODE_DIED}
        return [f for f in faults if not set(f.ranks) <= ranks
                or (f.kind is FaultKind.NODE_DIED and f.node not in nodes)]

    def retry(self, slots: dict[int, RankSlot]) -> None:
        """Called every poll: plan a parked recovery again once a spare is warm; past the
        deadline, fail the job (``PlanInfeasible``) naming what it waited for."""
        waiting = self.waiting
        if waiting is None or self.clock() < waiting.next_try:
            return
        if self.clock() > waiting.deadline:
            self.phases.transition(Phase.FAILED, "no capacity before the deadline")
            raise PlanInfeasible(f"{waiting.reason}; none came within spares.wait_timeout_s="
                                 f"{self.cfg.spares.wait_timeout_s}")
        if len(self._spares().spares) >= waiting.needed:
            self.recover(waiting.faults, slots, replay=True)
        else:
            waiting.next_try = self.clock() + WAIT_RETRY_S

    def _world(self, slots: dict[int, RankSlot], reports: Mapping[str, KeeperReport],
               tiers: TierInventory) -> WorldView:
        """The committed step is the newest of: the tracked commit point, the newest step
        every rank has in a live keeper, and the newest complete tier step."""
        ranks = sorted(slots)
        return WorldView(
            generation=Generation(self.generation), world_size=self.cfg.job.world_size,
            rank_workers={Rank(r): WorkerId(slots[r].worker_id) for r in ranks},
            worker_nodes={WorkerId(slots[r].worker_id): node_name(slots[r].node) for r in ranks},
            live_nodes=frozenset(node_name(n) for n in self.live_nodes),
            committed_step=Step(max(self.committed(), committed_step(reports, ranks, 0),
                                    *(max(steps) for steps in tiers.complete_steps.values()
                                      if steps))))

    def _fresh_reports(self) -> dict[str, KeeperReport]:
        """What every live keeper holds right now (etcd reports may be a heartbeat old)."""
        live = {n: self.keepers[n] for n in self.live_nodes if n in self.keepers}
        refs = {n: (actor.holdings.remote(), actor.stats.remote()) for n, (actor, _) in live.items()}
        reports: dict[str, KeeperReport] = {}
        for node, (holdings_ref, stats_ref) in refs.items():
            try:
                answer = self._first_try(_getter([holdings_ref, stats_ref]), node)
                if answer is None:          # silent: taken for lost
                    continue
                holdings, stats = answer
            except Exception as exc:  # a keeper that does not answer holds nothing usable
                self.events.emit("keeper_unreachable", node=node_name(node),
                                 error=str(exc).splitlines()[0][:200])
                if isinstance(exc, RayActorError):  # its node (and memory) is gone
                    self._forget_node(node_name(node))
                continue
            reports[node_name(node)] = report_from_keeper(node_name(node), live[node][1],
                                                          holdings, stats, self.generation)
        return reports

    @staticmethod
    def _replicas(reports: Mapping[str, KeeperReport]) -> ReplicaMap:
        holdings: dict[int, dict[str, set[int]]] = {}
        for node, report in reports.items():
            for source in (report.local, report.replicas):
                for rank, steps in source.items():
                    holdings.setdefault(rank, {}).setdefault(node, set()).update(steps)
        return ReplicaMap.of(holdings)

    def _tiers(self) -> TierInventory:
        """Every tier's complete steps, listed in parallel within
        ``tier_inventory_bound_s``: a tier that fails or does not answer in time (an S3
        endpoint that accepts connections and never replies) offers no checkpoint, and
        says so in a ``tier_unreachable`` event. A listing past the bound is left to end on
        its own thread (its client's own timeouts)."""
        bound = tier_inventory_bound_s(self.cfg.recovery.group_timeout_s)
        listings = [TierListing(tier).start()
                    for tier, _, _ in build_tiers(self.cfg, self.run_dir)]
        deadline = self.clock() + bound
        steps: dict[str, tuple[Step, ...]] = {}
        for listing in listings:
            listing.thread.join(max(0.0, deadline - self.clock()))
            name = listing.tier.name
            if listing.thread.is_alive():
                self.events.emit("tier_unreachable", tier=name, timeout_s=bound,
                                 error=f"no answer listing its checkpoints within {bound:g} s "
                                       "(min(10, recovery.group_timeout_s)); planned without it")
            elif listing.error is not None:  # an unreachable tier offers no checkpoint
                self.events.emit("tier_unreachable", tier=name, error=repr(listing.error))
            else:
                steps[name] = tuple(Step(s) for s in listing.steps)
        return TierInventory(steps)

    def _spares(self) -> SpareInventory:
        if self.pool is None:
            return SpareInventory({})
        warm = self.pool.inventory(self.live_nodes)
        return SpareInventory({SpareId(s): node_name(n) for s, n in warm.items()},
                              {SpareId(s): node_name(n) for s, n
                               in self.pool.warming(self.live_nodes, set(warm)).items()})

    def _forget_node(self, node: str) -> None:
        index = node_index(node)
        self.live_nodes.discard(index)
        if self.pool is not None:
            self.pool.forget_node(index)

    # -- acting on the plan ------------------------------------------------------------
    def _fence(self, plan: RecoveryPlan, deadline: float) -> None:
        """Publish plan/<g> and move ``generation`` to g in one etcd transaction, fenced on
        the generation's revision as this coordinator read it: a stalled ex-leader can
        overwrite neither. etcd unreachable: tried again until ``deadline``
        (``RecoveryStalled`` after). Raises ``FenceLost`` when another coordinator moved
        the generation: this one stops like after a lost lease."""
        worker_plan = self.worker_plan(plan)
        encoded = worker_plan.encode()
        key = plan_key(plan.generation)

        def attempt() -> int | None:
            """None once fenced; else the generation found (another coordinator's)."""
            current = self.membership.get(GENERATION_KEY)
            found = int(current.value) if current is not None else 0
            if found == plan.generation:   # our own write whose answer was lost?
                published = self.membership.get(key)
                if published is not None and published.value == encoded:
                    return None
            if found != self.generation:
                return found
            expected = current.mod_revision if current is not None else 0
            if self.membership.put_if(GENERATION_KEY, expected, {
                    key: encoded, GENERATION_KEY: str(plan.generation).encode()}):
                return None
            return -1       # moved between our read and the transaction

        moved = self._retry(attempt, f"fencing generation {plan.generation}", deadline)
        if moved is not None:
            self.events.emit("fence_lost", generation=plan.generation,
                             found=moved if moved >= 0 else None)
            raise FenceLost(
                f"generation {plan.generation} could not be fenced: etcd's generation is "
                f"{moved if moved >= 0 else 'newer'}, not {self.generation}, so another "
                "coordinator leads this job; this launcher stops and leaves the job's "
                "processes to it")
        self.generation = plan.generation
        self._current_plan = worker_plan

    def worker_plan(self, plan: RecoveryPlan) -> GenerationPlan:
        """The worker-facing plan: per rank its worker and the planner's restore sources
        with their addresses (a source this launcher cannot address is left out)."""
        ranks = {}
        for rank, worker in plan.rank_workers.items():
            resolved = (self._address(s) for s in plan.sources.get(rank, ()))
            ranks[int(rank)] = RankAssignment(str(worker), tuple(s for s in resolved if s))
        return GenerationPlan(plan.generation, self.cfg.job.world_size, plan.restore_step,
                              ranks, plan.reason, self.store_address, self.heals(plan))

    def heals(self, plan: RecoveryPlan) -> bool:
        """Whether the generation heals from live peers (``recovery.heal_from_peers``):
        some survivor keeps its state, something is committed to fall back to, and no
        silent corruption asks for a rollback to a verified step."""
        replaced = sum(isinstance(a, (PromoteSpare, RestartWorker)) for a in plan.actions)
        return (self.cfg.recovery.heal_from_peers and plan.restore_step >= 0
                and replaced < self.cfg.job.world_size
                and not any(isinstance(a, RepairFromPeer) for a in plan.actions))

    def _address(self, source: RestoreSource) -> RestoreSource | None:
        """``source`` with where to find it: a keeper's host and port, a tier's root."""
        match source:
            case KeeperCopy(node=node) | PeerCopy(node=node):
                keeper = self.keepers.get(node_index(node))
                if keeper is None:
                    return None
                host, port = keeper[1]
                if isinstance(source, PeerCopy):
                    return dataclasses.replace(
                        source, host=host, port=int(port),
                        objects=tuple(self.cfg.detection.replicated_state))
                return dataclasses.replace(source, host=host, port=int(port))
            case TierCopy(tier="disk"):
                if not self.cfg.tiers.disk.enabled:
                    return None
                return dataclasses.replace(
                    source, path=str(disk_tier_root(self.cfg, self.run_dir)))
            case TierCopy(tier="s3"):
                if not self.cfg.tiers.s3.enabled:
                    return None
                return dataclasses.replace(source, s3=dataclasses.asdict(self.cfg.tiers.s3))
            case TierCopy():
                return None
            case _:
                assert_never(source)

    def _promote(self, plan: RecoveryPlan, slots: dict[int, RankSlot],
                 faults: Sequence[FaultReport]) -> None:
        fenced = {r for f in faults if f.kind in (FaultKind.STALLED, FaultKind.LEASE_LOST,
                                                  FaultKind.PARTITIONED,
                                                  FaultKind.WORKER_EXCEPTION) for r in f.ranks}
        for rank in fenced:  # a hung, cut-off or failed rank must die so it never acts again
            with contextlib.suppress(Exception):
                ray.kill(slots[rank].actor, no_restart=True)
        replaced = sum(isinstance(a, (PromoteSpare, RestartWorker)) for a in plan.actions)
        # a rank that joins survivors skips its script's set-up collectives (they are past
        # them: phalanx.runtime.group.default_group); a whole new world runs them. Nothing
        # committed (restore step -1): every rank starts its entrypoint afresh, as at launch
        restore: dict[str, Any] | None = {
            "step": plan.restore_step, "joins_survivors": replaced < self.cfg.job.world_size,
            "heal": self.heals(plan),
        } if plan.restore_step >= 0 else None
        initial = self._initial_restore() if restore is None else None
        worker_plan = self._current_plan
        for action in plan.actions:
            warming = isinstance(action, PromoteSpare) and not action.warm
            match action:
                case PromoteSpare(spare=spare_id, rank=rank, node=node):
                    assert self.pool is not None
                    spare = self.pool.take(str(spare_id))
                    slot = RankSlot(rank, str(spare_id), spare.node, spare.actor,
                                    name=spare.name)
                case RestartWorker(rank=rank, node=node):
                    slot = RankSlot(rank, str(plan.rank_workers[rank]),
                                    node_index(node), None)
                case RestoreFromKeeper() | RestoreFromTier() | RepairFromPeer() | Rollback() \
                        | WaitForCapacity() | Abort():
                    continue
                case _:
                    assert_never(action)
            old = slots.get(rank)
            if old is not None and old.actor is not None and old.worker_id != slot.worker_id:
                with contextlib.suppress(Exception):   # (a survivor starting over)
                    ray.kill(old.actor, no_restart=True)
            sources = [source_to_json(s) for s in worker_plan.ranks[rank].sources]
            slot.ref = self.launch(slot, plan.generation, initial if restore is None
                                   else {**restore, "sources": sources})
            slots[rank] = slot
            self.events.emit("promoted", rank=rank, worker=slot.worker_id,
                             node=node_name(slot.node), generation=plan.generation,
                             **({"warming": True} if warming else {}))

    def _initial_restore(self) -> dict[str, Any] | None:
        """What a rank restarted with nothing committed starts from: the resume checkpoint
        in a run started with ``--resume`` (each rank verifies its HMAC and checksums
        again as it restores, as at launch), else None (its script's initial state)."""
        if self.resumed_from is None:
            return None
        restore, run_id = self.resumed_from
        self.events.emit("restart_from_resume", step=restore["step"], run_id=run_id,
                         generation=self.generation)
        return {**restore, "joins_survivors": False}

    # -- resuming ----------------------------------------------------------------------
    def check_resumed(self, members: Mapping[str, MemberRecord]) -> dict[str, Any] | None:
        """When every rank has finished a step in the new generation: the recovery record."""
        pending = self.pending
        if pending is None:
            return None
        if pending.workers_up_at is None:   # (this poll may be the first to see them)
            pending.workers_up_at = _workers_up_at(pending, members)
        ranks = {m.rank: m for m in members.values() if m.rank >= 0
                 and m.generation == pending.generation and m.step > pending.restore_step
                 and float(m.extra.get("first_step_at") or 0) > 0}
        if len(ranks) < self.cfg.job.world_size:
            return None
        first_step = max(float(m.extra["first_step_at"]) for m in ranks.values())
        # a heal resumed at the step the ranks agreed on (every rank reports it), not at
        # the plan's committed step: the steps lost are counted from there
        restored = [r.extra.get("restored") or {} for r in ranks.values()]
        healed = [int(h["step"]) for h in restored if h.get("healed")
                  and h.get("generation") == pending.generation]
        was_healed = bool(healed) and len(healed) == len(ranks)
        resumed = min(healed) if was_healed else pending.restore_step
        return self._complete(pending, first_step, resumed, was_healed)

    def _complete(self, pending: Recovery, first_step: float, resumed: int,
                  healed: bool, restarted: bool = False) -> dict[str, Any]:
        """Record the pending recovery as done: every rank took its first step in the new
        generation at ``first_step`` (or returned there after joining it; ``restarted``:
        a job without a Session, whose ranks started their script over at
        ``first_step``)."""
        if self.phases.phase is Phase.RESTORING:
            self.phases.transition(Phase.RESUMING, "ranks rejoined")
        self.phases.transition(Phase.STEADY, f"generation {pending.generation} stepping")
        phases = dict(pending.phases)
        for change in self.phases.history[pending.phase_start + 1:]:
            phases[change.from_phase.value] = round(change.duration_s, 4)
        newest = pending.restore_step + pending.lost_steps
        record = {"generation": pending.generation, "restore_step": resumed,
                  "first_step_at": first_step, "healed": healed,
                  "fault": pending.root.kind.value, "ranks": list(pending.root.ranks),
                  "fault_to_first_step_s": round(first_step - pending.fault_wall, 3),
                  "lost_steps": max(0, newest - resumed), "phases_s": phases,
                  "reason": pending.plan_reason}
        if restarted:
            record["restarted"] = True
        if pending.workers_up_at is not None:     # (None when it started no worker)
            record["workers_up_at"] = pending.workers_up_at
        self.history.append(record)
        self.events.emit("recovered", **record)
        self.pending = None
        with contextlib.suppress(Exception):   # the generation's restore reports: done with
            for rank in read_reports(self.membership, pending.generation):
                self.membership.delete(restore_key(pending.generation, rank))
        if self.pool is not None:  # refilled after the recovery, not competing with it
            self.pool.refill(sorted(self.live_nodes))
        return record


def _workers_up_at(pending: Recovery, members: Mapping[str, MemberRecord]) -> float | None:
    """When the last of the recovery's spares and fresh workers was running (a fresh
    worker's start-up ends there): each one's earliest evidence in its member record of
    the new generation, the record's write time or its first step (a record seen a poll
    late was written after the step); None while one has not registered."""
    if not pending.new_workers:
        return None
    now, up = time.time(), 0.0
    for worker in pending.new_workers:
        record = members.get(worker)
        if record is None or record.generation != pending.generation:
            return None
        seen = [float(record.extra.get(k) or now) for k in ("time", "first_step_at")]
        up = max(up, min(now, *seen))
    return up


def _getter(refs: list[Any]) -> Callable[..., Any]:
    """``ray.get(refs)`` as a keeper call: ``limit_s`` bounds one try."""
    return lambda limit_s: ray.get(refs, timeout=limit_s)
