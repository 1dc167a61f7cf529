"""The composition root of ``phalanx launch``: start services, place worker actors over the
nodes, watch progress and results, and tear everything down however the run ends."""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Callable, Mapping, Sequence

import ray
from rich.console import Console

from phalanx.configs.errors import ConfigError, PhalanxError, PlanInfeasible, TransientError
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.base import (FINISHED_PREFIX, Generation, MemberRecord, Rank, Step, WorkerId,
                                  group_formed_key, node_name)
from phalanx.runtime.tiers.config import build_tiers
from phalanx.launcher.coordination.commit_tracker import CommitTracker, reset_commit_point
from phalanx.launcher.coordination.bounds import fault_after_finish, unfinished_faults
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.drills.seam import JobDrills
from phalanx.launcher.run_observer import RunObserver
from phalanx.launcher.resume import ResumePoint, adopt_secret, announce, find_resume_point
from phalanx.launcher.run_files import gather_run_files
from phalanx.launcher.run_summary import record_run_end, record_startup_lost
from phalanx.launcher.services.etcd_outage import EtcdOutage, outage_grace_s
from phalanx.launcher.events import EventLog
from phalanx.launcher.keeper_events import KEEPER_EVENTS_FINAL_WAIT_S, KeeperEvents
from phalanx.launcher.preflight import check_before_start
from phalanx.launcher.goodput import goodput_from_events
from phalanx.launcher.metrics import JobMetrics
from phalanx.launcher.coordination.keeper_restart import KeeperRestarts, start_keeper_actor
from phalanx.launcher.keeper_actor import SETTLE_TIERS_S
from phalanx.launcher.coordination.monitor import Monitor, PollResult
from phalanx.launcher.coordination.node_watch import NodeWatch
from phalanx.launcher.progress import ProgressView
from phalanx.launcher.services.ray_cluster import node_resource, raylet_addresses
from phalanx.launcher.rundir import RunDir
from phalanx.launcher.services.leadership import JobState, LeadershipLost, read_state
from phalanx.launcher.coordination.takeover import (StatePublisher, adopt_keepers, adopt_workers,
                                                    job_state, resume_coordinator)
from phalanx.launcher.services.stack import Services, join_services, start_services
from phalanx.spares.actor import WorkerActor
from phalanx.spares.pool import SparePool
from phalanx.runtime.worker.entrypoint import is_script
from phalanx.recovery.base import FaultKind, FaultReport, WorldView
from phalanx.recovery.detection import (ActorDied, CollectiveError, KeeperLeaseExpired, NodeLost,
                                        StallDetector, classify)
from phalanx.runtime.context import DEFAULT_PLAN_TIMEOUT_S, WorkerContext
from phalanx.runtime.logs import current_format
from phalanx.runtime.membership.generation import GENERATION_KEY
from phalanx.runtime.membership.etcd import client_fields
from phalanx.runtime.tiers.config import read_job_secret
from phalanx.runtime.keeper.memory_plan import check_config_plan
from phalanx.runtime.keeper.shm import remove_stale, shm_prefix

log = logging.getLogger(__name__)


class JobTimeout(PhalanxError):
    """The job ran longer than ``job.timeout_s``."""


@dataclass
class JobResult:
    run_dir: Path
    results: dict[int, Any] = field(default_factory=dict)
    seconds: float = 0.0
    keepers: dict[str, Any] = field(default_factory=dict)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)   # summary.json (run_summary)


class StartupLost(TransientError):
    """Ray lost a node before the job's first step; the launch is tried again (at most
    ``STARTUP_ATTEMPTS`` in all)."""


# a second start-up loss was seen in CI on a loaded 2-core machine right after a first,
# drilled one: three attempts, each from scratch, logged (event=startup_retry)
STARTUP_ATTEMPTS = 3
# a node report (its ranks' records, rewritten every heartbeat) standing still this many
# heartbeats is not current: its ranks are not judged stalled on it
REPORT_STALE_BEATS = 3
KEEPER_START_S = 60.0    # the job's keepers, each its node's first Ray worker, start within
KEEPER_CLOSE_S = 10.0    # a job's keepers unlink their shared memory within this, together
# every rank's script formed its first group this long ago and no Session reported: the
# job trains without one, and a node lost from then on is no start-up race (_scripts_formed_group)
SESSIONLESS_AFTER_S = 10.0
NODE_LOSS_KINDS = (FaultKind.WORKER_DIED, FaultKind.NODE_DIED, FaultKind.KEEPER_DIED,
                   FaultKind.LEASE_LOST, FaultKind.COLLECTIVE_ERROR)


def dead_ray_nodes() -> list[str]:
    """The node ids Ray's node table lists as dead ([] when Ray cannot be asked)."""
    try:
        return [n["NodeID"] for n in ray.nodes() if not n.get("Alive")]
    except Exception:  # process boundary: a Ray that cannot answer tells nothing here
        return []


class JobRunner:
    """Runs one job to completion. ``run()`` returns a ``JobResult`` or raises the root
    cause (``WorkerFailed`` with the rank's traceback, ``ServiceStartError``, ...)."""

    def __init__(self, cfg: PhalanxConfig, console: Console | None = None,
                 base_dir: Path | None = None, standby: bool = False,
                 resume: str | None = None) -> None:
        self.cfg = cfg
        self.resume = resume                 # --resume (phalanx.launcher.resume)
        self.resume_point: ResumePoint | None = None
        self.console = console or Console(stderr=True)
        self.entrypoint = check_before_start(cfg, base_dir or Path.cwd())
        self.secret_hex = ""
        self.keepers: dict[int, tuple[Any, tuple[str, int]]] = {}
        self.standby = standby
        self.handed_over = False   # lost the lease: leave the job's actors to the successor
        self._lifetime = {"lifetime": "detached"} if cfg.coordinator.standby else {}
        self._publisher: StatePublisher | None = None
        self._signals_at_start: list[ActorDied] = []
        self._slots: dict[int, RankSlot] = {}      # who runs each rank now (LOCAL_RANK)
        self.drills: JobDrills | None = None         # only when the config turns drills on
        self.metrics: JobMetrics | None = None       # only with metrics.port
        self._started_at = time.time()   # the launch on the wall clock (goodput); reset in run
        self._first_step_seen = False    # a rank finished a step (no start-up retry after)
        self._session_seen = False       # a rank's Session reported (else: restart, no heal)
        self._formed_at: float | None = None   # every rank's script formed its first group
        self._dead_at_start: list[str] = []   # Ray nodes already dead when Ray came up
        self._stop_signal: int | None = None  # SIGINT or SIGTERM received
        if standby and not cfg.coordinator.standby:
            raise ConfigError("coordinator.standby", "false, but --standby was given",
                              "set coordinator.standby: true in the job's config (leader and "
                              "standby share it)")

    def _stopped_by(self, signum: int) -> None:
        self._stop_signal = signum

    def run(self) -> JobResult:
        if self.standby:
            return self._take_over()
        started = time.monotonic()
        self._started_at = time.time()      # the launch, on the wall clock (goodput)
        self._check_memory()
        self.cfg, self.drills = JobDrills.open(self.cfg)
        try:
            self._check_tiers()
            if self.resume:    # verified before anything starts; ResumeRefused otherwise
                self.resume_point = find_resume_point(self.cfg, self.resume)
            for attempt in range(1, STARTUP_ATTEMPTS + 1):
                try:
                    return self._run_once(started)
                except StartupLost as exc:
                    if attempt == STARTUP_ATTEMPTS:
                        raise
                    log.warning("event=startup_retry attempt=%d error=%s", attempt, exc)
                    self.console.print(f"phalanx: warning: {exc}; everything started was "
                                       "stopped, starting the job once more", markup=False)
            raise AssertionError("unreachable")
        finally:
            if self.drills is not None:
                self.drills.close()

    def _run_once(self, started: float) -> JobResult:
        """One launch in a fresh run directory; ``StartupLost`` when Ray lost a node before
        the job's first step (services, keepers, spares, ranks: all stopped again)."""
        self.keepers, self._slots, self._signals_at_start = {}, {}, []
        self._first_step_seen = self._session_seen = False
        self._formed_at = None
        run = RunDir.create(self.cfg)
        if self.resume_point is not None:
            adopt_secret(run.path, self.resume_point, self.cfg)
        self.secret_hex = job_secret(self.cfg, run).hex()
        self.console.print(f"phalanx: run directory {run.path}", markup=False)
        with contextlib.ExitStack() as stack:
            _install_stop_signals(stack, self._stopped_by)
            services = start_services(self.cfg, run, stack)
            _install_stop_signals(stack, self._stopped_by)
            self._dead_at_start = dead_ray_nodes()
            stack.callback(self._release_shared_memory)     # after the keepers closed
            run.write_job({"job": self.cfg.job.name, "etcd_endpoints": services.etcd_endpoints,
                           "etcd_prefix": self.cfg.etcd.prefix, "launcher_pid": os.getpid(),
                           "etcd_client": client_fields(self.cfg.etcd),
                           "world_size": self.cfg.job.world_size,
                           "started_at": self._started_at, "run_id": run.path.name,
                           "launcher_host": socket.gethostname()})
            self._use(services, stack)
            reset_commit_point(services.membership)     # not an earlier run's (shared etcd)
            try:
                # keepers, spares, then ranks (_start_workers): starting every actor at once
                # right after Ray came up (each imports torch) starved the fresh raylets'
                # agents on 2 cores and Ray lost a node at start-up in 3 of ~40 CI launches
                parts = dict(services.started_s)   # where the start-up's seconds went
                begun = time.monotonic()
                self._start_keepers(services, run, stack)
                parts["keepers"] = time.monotonic() - begun
                events = EventLog(run.path / "events.jsonl", services.membership)
                stack.callback(events.close)     # before the membership closes (LIFO)
                self._open_metrics(events, stack)
                begun = time.monotonic()
                pool = self._start_spares(stack)
                parts["spares"] = time.monotonic() - begun
                coordinator = self._coordinator(run, services, events, pool)
                coordinator.fence_initial()
                events.emit("started", world_size=self.cfg.job.world_size,
                            nodes=self.cfg.job.nodes, spares=self.cfg.spares.count,
                            startup_s={k: round(v, 3) for k, v in parts.items()},
                            **({"ray_start_failures": services.local_ray.failures}
                               if services.local_ray and services.local_ray.failures else {}))
                if self.resume_point is not None:
                    announce(self.resume_point, events, self.console)
                slots = self._start_workers(run)
                if self.keepers:
                    coordinator.place(slots)
            except Exception as exc:
                try:
                    self._check_startup_nodes(exc)
                except StartupLost as lost:
                    record_startup_lost(run.path, self.cfg.job.name, self.cfg.job.world_size,
                                        self._started_at, lost)
                    raise
                raise
            return self._finish(run, slots, coordinator, started)

    def _ray_death_s(self) -> float:
        """How long Ray takes to declare a killed raylet dead, plus a second."""
        ray_cfg = self.cfg.ray
        return ray_cfg.health_check_period_ms * ray_cfg.health_check_failure_threshold / 1000 + 1

    def _scripts_formed_group(self) -> bool:
        """Whether every rank's script formed the first generation's default group at least
        ``SESSIONLESS_AFTER_S`` ago and no Session has reported since: a script without a
        Session trains from there and reports no step, so a node lost later is a fault to
        restart its ranks from, not Ray's own start-up race (which relaunched the whole job
        in a new run directory, uncounted by ``recovery.max_recoveries``). The delay keeps
        a Session job's start-up (its Session reports within seconds of the group) as it
        was."""
        if self._formed_at is None:
            try:
                formed = self.services.store.add(group_formed_key(0), 0)
            except RuntimeError:        # the store is the launcher's own: not expected
                return False
            if formed < self.cfg.job.world_size:
                return False
            self._formed_at = time.monotonic()
        return time.monotonic() - self._formed_at >= SESSIONLESS_AFTER_S

    def _check_startup_nodes(self, cause: BaseException | str, wait_s: float = 0.0) -> None:
        """Raise ``StartupLost`` when a Ray node died since Ray came up (Ray asked for up
        to ``wait_s``: a lost node's processes are noticed before Ray's health check
        declares it dead) and no rank has finished a step yet: nothing of the job is
        lost, so it starts once more rather than failing (seen on loaded 2-core machines:
        a raylet missing its health checks while five processes import torch)."""
        if self._first_step_seen:
            return
        deadline = time.monotonic() + wait_s
        while not (lost := sorted(set(dead_ray_nodes()) - set(self._dead_at_start))):
            if time.monotonic() >= deadline:
                return
            time.sleep(0.2)
        local = self.services.local_ray
        exits = f" (raylet exit status by node: {local.raylet_exits()})" if local else ""
        raise StartupLost(f"Ray lost {len(lost)} node(s) ({', '.join(n[:12] for n in lost)}) "
                          f"before the job's first step{exits}: {str(cause)[:300]}")

    def _finish(self, run: RunDir, slots: dict[int, RankSlot],
                coordinator: RecoveryCoordinator, started: float) -> JobResult:
        try:
            results = self._watch(run, slots, coordinator)
        except LeadershipLost:
            self.handed_over = True
            raise
        except (PhalanxError, KeyboardInterrupt) as exc:  # the report names what ended it
            if isinstance(exc, PhalanxError) and self._lost_leadership():
                self.handed_over = True    # a standby leads: the job is its, not torn down
                raise LeadershipLost(f"{exc} (this launcher no longer leads: the job is "
                                     "left to the standby)") from exc
            coordinator.events.emit("job_failed", error_type=type(exc).__name__,
                                    message=str(exc)[:2000])
            self._gather_run_files(run, coordinator.live_nodes)
            record_run_end(run.path, "failed", coordinator, started, error=exc)
            raise
        self._gather_run_files(run, coordinator.live_nodes)
        holdings = self._keeper_holdings(coordinator.live_nodes)
        coordinator.events.emit("finished", recoveries=coordinator.recoveries)
        result = JobResult(run.path, results, time.monotonic() - started, holdings,
                           coordinator.history,
                           record_run_end(run.path, "finished", coordinator, started, results))
        self.console.print(f"phalanx: job {self.cfg.job.name} finished in {result.seconds:.1f} s")
        return result

    # -- standing by -----------------------------------------------------------------------
    def _take_over(self) -> JobResult:
        """Wait until the job's leader is gone, then carry the job on from the state it
        published: the same workers, keepers and spares (found by name), a new TCPStore."""
        cfg = self.cfg
        self.drills = None        # drills are the leader's; faults it fired are history
        with contextlib.ExitStack() as stack:
            _install_stop_signals(stack, self._stopped_by)
            self.console.print(f"phalanx: standing by for job {cfg.job.name}")
            services = join_services(cfg, stack, lambda holder: self.console.print(
                f"phalanx: job {cfg.job.name} is led by pid {holder.get('pid')} on "
                f"{holder.get('host')}; standing by", markup=False))
            _install_stop_signals(stack, self._stopped_by)
            started = time.monotonic()
            self._use(services, stack)
            stack.callback(self._release_shared_memory)
            state = read_state(services.membership)
            run = RunDir(Path(state.run_dir))
            self.secret_hex = job_secret(cfg, run).hex()
            self.keepers = adopt_keepers(state)
            stack.callback(self._close_keepers, {n: a for n, (a, _) in self.keepers.items()})
            events = EventLog(run.path / "events.jsonl", services.membership)
            stack.callback(events.close)
            self._open_metrics(events, stack)
            pool = self._start_spares(stack, state)
            coordinator = self._coordinator(run, services, events, pool)
            current = services.membership.get(GENERATION_KEY)
            generation = int(current.value) if current else state.generation
            resume_coordinator(coordinator, state, generation,
                               set(self.keepers) if cfg.snapshot.enabled else None)
            slots, self._signals_at_start, doomed = adopt_workers(
                state, generation, services.membership, cfg.job.name)
            self._slots = slots
            for slot in slots.values():
                if slot.actor is not None:
                    stack.callback(self._release_actor, slot.actor)
            for name in doomed:      # replacements a dead leader may have started
                with contextlib.suppress(ValueError):
                    _kill_actor(ray.get_actor(name))
                if pool is not None:
                    pool.discard(name)
            events.emit("coordinator_takeover", pid=os.getpid(), generation=coordinator.generation,
                        state_generation=state.generation, run_dir=str(run.path),
                        lost_at_takeover=[s.worker_id for s in self._signals_at_start])
            self.console.print(f"phalanx: took over job {cfg.job.name} at generation "
                               f"{coordinator.generation} (run directory {run.path})",
                               markup=False)
            return self._finish(run, slots, coordinator, started)

    def _use(self, services: Services, stack: contextlib.ExitStack) -> None:
        self.services, self._stack = services, stack
        if self.cfg.coordinator.standby:
            self._publisher = StatePublisher(services.membership)

    def _open_metrics(self, events: EventLog, stack: contextlib.ExitStack) -> None:
        """The Prometheus endpoint (``metrics.port``; 0: none), fed by the job's events and
        the watch loop (``_observe``)."""
        cfg = self.cfg
        if cfg.metrics.port == 0:
            return
        tiers = [name for name, tier in (("disk", cfg.tiers.disk), ("s3", cfg.tiers.s3))
                 if tier.enabled and cfg.snapshot.enabled]
        self.metrics = JobMetrics(cfg.metrics, cfg.job.world_size, tiers).start()
        stack.callback(self.metrics.close)
        events.add_listener(self.metrics.on_event)
        self.console.print(f"phalanx: metrics at http://{cfg.metrics.host}:"
                           f"{self.metrics.port}/metrics")

    def _observe(self, members: Mapping[str, MemberRecord], coordinator: RecoveryCoordinator,
                 commits: CommitTracker) -> None:
        """Refresh the endpoint's gauges (at most every ``metrics.UPDATE_EVERY_S``)."""
        metrics = self.metrics
        if metrics is None or not metrics.due():
            return
        metrics.observe_members(members)
        metrics.observe_job(coordinator.generation, commits.committed, len(coordinator.live_nodes))
        if metrics.goodput_due():
            metrics.observe_goodput(goodput_from_events(coordinator.events.events,
                                                        self._started_at, time.time()))
        metrics.observe_reports(commits.reports, self.cfg.replication.copies)
        if coordinator.pool is not None:
            metrics.observe_spares(*coordinator.pool.readiness())

    def _publish_state(self, run: RunDir, slots: dict[int, RankSlot],
                       coordinator: RecoveryCoordinator) -> None:
        """What a standby needs, when it changed (only with coordinator.standby)."""
        if self._publisher is not None:
            self._publisher.publish(job_state(str(run.path), self.cfg.job.name, slots,
                                              self.keepers, coordinator))

    def _coordinator(self, run: RunDir, services: Services, events: EventLog,
                     pool: SparePool | None) -> RecoveryCoordinator:
        coordinator = RecoveryCoordinator(
            self.cfg, services.membership, self.keepers, pool,
            # a worker started by a recovery: the recoveries before it, this one counted
            lambda slot, gen, restore: self._launch(run, slot, gen, restore,
                                                    coordinator.recoveries + 1), events,
            str(run.path))
        coordinator.store_address = (services.store_host, services.store.port)
        coordinator.still_leading = self._check_leadership   # asked between recovery retries
        if self.resume_point is not None:   # a restart before the first commit restores it
            coordinator.resumed_from = (self.resume_point.restore_for(self.cfg),
                                        self.resume_point.checkpoint.run)
        return coordinator

    def _check_memory(self) -> None:
        """Refuse to start when shared memory cannot hold every node's snapshots."""
        check_config_plan(self.cfg)

    def _release_shared_memory(self) -> None:
        """What no keeper unlinked (its node lost or cut off, its process killed) goes when
        the job ends: the job's shared memory is the launcher's to clean up."""
        if self.handed_over or not self.cfg.snapshot.enabled:
            return
        for node in range(self.cfg.job.nodes):
            removed = remove_stale(self.cfg.snapshot.shm_dir,
                                   shm_prefix(self.cfg.job.name, node_name(node)))
            if removed:
                log.warning("event=shm_released_at_exit node=%s files=%d", node_name(node),
                            len(removed))

    def _check_tiers(self) -> None:
        """Credentials, buckets and folders are checked at launch, not at the first upload."""
        if not self.cfg.snapshot.enabled:
            return
        for tier, _, _ in build_tiers(self.cfg, str(Path(self.cfg.job.run_dir) / "_check")):
            if tier.name != "disk" or self.cfg.tiers.disk.path:
                tier.check()

    def _start_keepers(self, services: Services, run: RunDir, stack: contextlib.ExitStack) -> None:
        """One keeper per node, pinned to it, before any worker starts."""
        if not self.cfg.snapshot.enabled:
            return
        actors: dict[int, Any] = {}
        stack.callback(self._close_keepers, actors)     # every keeper started, at once
        for node in range(self.cfg.job.nodes):
            actors[node] = start_keeper_actor(
                self.cfg, node, self.secret_hex, services.etcd_endpoints, str(run.path),
                [r for r in range(self.cfg.job.world_size) if r % self.cfg.job.nodes == node])
        refs = [actor.address.remote() for actor in actors.values()]
        local = services.local_ray   # a lost node is a start-up attempt lost (StartupLost)
        addresses = (local.first_work(refs, "keepers", KEEPER_START_S) if local is not None
                     else ray.get(refs, timeout=KEEPER_START_S))
        self.keepers = {node: (actor, tuple(addr)) for (node, actor), addr
                        in zip(actors.items(), addresses)}

    def _start_spares(self, stack: contextlib.ExitStack,
                      adopt: JobState | None = None) -> SparePool | None:
        """The warm pool; a standby adopts the leader's spares (``adopt``) instead."""
        cfg = self.cfg
        if cfg.spares.count <= 0:
            return None
        pool = SparePool(cfg.spares.count, self.entrypoint, cfg.job.torch_threads,
                         cfg.spares.warmup, cfg.job.cpus_per_worker, node_resource, cfg.job.name,
                         detached=cfg.coordinator.standby, resources=cfg.spares.resources,
                         nodes=cfg.spares.nodes if cfg.spares.placement == "nodes" else None,
                         replenish=cfg.spares.replenish, rank_nodes=self._rank_nodes)
        stack.callback(lambda: None if self.handed_over else pool.close())
        if adopt is not None:
            return pool.adopt(adopt.spares, adopt.spare_serial)
        return pool.start(list(range(cfg.job.nodes)))

    def _gather_run_files(self, run: RunDir, live: set[int]) -> None:
        """The live nodes' rank logs into this run directory, where no filesystem is shared
        (``launcher.run_files``; a node that does not answer is logged, never raised)."""
        gather_run_files(run.path, {node_name(node): self.keepers[node][0]
                                    for node in self.keepers if node in live})

    def _keeper_holdings(self, live: set[int]) -> dict[str, Any]:
        """What each live keeper holds at the end of the run (for the summary and tests)."""
        nodes = [node for node in self.keepers if node in live]
        refs = [self.keepers[node][0].holdings.remote() for node in nodes]
        held: dict[str, Any] = {}
        for node, ref in zip(nodes, refs):
            try:
                held[node_name(node)] = ray.get(ref, timeout=30)
            except ray.exceptions.RayActorError:   # died as the run ended (being replaced)
                log.warning("event=keeper_holdings_lost node=%s", node_name(node))
        return held

    def _context(self, run: RunDir, slot: RankSlot, generation: int,
                 restore: dict | None, restarts: int) -> WorkerContext:
        cfg, services = self.cfg, self.services
        keeper_host, keeper_port = self.keepers[slot.node][1] if slot.node in self.keepers \
            else ("", 0)
        return WorkerContext(
            job=cfg.job.name, rank=slot.rank, world_size=cfg.job.world_size,
            local_rank=assign_local_rank(self._slots, slot),
            local_world_size=local_world_size(self._slots, slot),
            node=node_name(slot.node),
            worker_id=slot.worker_id, generation=generation, restart_count=restarts,
            max_restarts=cfg.recovery.max_recoveries, master_addr=services.store_host,
            master_port=services.store.port, etcd_endpoints=tuple(services.etcd_endpoints),
            etcd_prefix=cfg.etcd.prefix, lease_ttl_s=cfg.etcd.lease_ttl_s,
            heartbeat_s=cfg.etcd.heartbeat_s, group_timeout_s=cfg.recovery.group_timeout_s,
            run_dir=str(run.path), torch_threads=cfg.job.torch_threads,
            keeper_host=keeper_host, keeper_port=keeper_port,
            snapshot_every=str(cfg.snapshot.every_steps),
            overhead_budget=cfg.snapshot.overhead_budget,
            tier_windows=tuple(w for w in cfg.tiers.windows(cfg.snapshot.every_steps).values()
                               if w > 0),
            checksum=cfg.snapshot.checksum,
            secret_hex=self.secret_hex, etcd_client=client_fields(cfg.etcd),
            plan_timeout_s=plan_timeout_s(cfg), drills=cfg.drills.active,
            drill_gates=() if self.drills is None else self.drills.gate_steps(),
            log_format=current_format(), config_yaml=run.config_text(),
            extra={"restore": restore} if restore else {})

    def _new_actor(self, node: int, name: str) -> Any:
        cfg = self.cfg
        actor = WorkerActor.options(  # type: ignore[attr-defined]  # @ray.remote adds options
            num_cpus=cfg.job.cpus_per_worker, resources={node_resource(node): 1},
            name=f"{cfg.job.name}-{name}", **self._lifetime).remote(
                self.entrypoint, cfg.job.torch_threads, cfg.spares.warmup, current_format())
        self._stack.callback(self._release_actor, actor)
        return actor

    def _release_actor(self, actor: Any) -> None:
        if not self.handed_over:
            _kill_actor(actor)

    def _close_keeper(self, actor: Any) -> None:
        self._close_keepers({0: actor})

    def _close_keepers(self, actors: Mapping[int, Any]) -> None:
        if not self.handed_over:
            _close_keepers(list(actors.values()))

    def _launch(self, run: RunDir, slot: RankSlot, generation: int, restore: dict | None,
                restarts: int = 0) -> Any:
        """Start ``slot``'s entrypoint (a fresh actor when it has none); returns the ref.
        ``restarts``: the job's recoveries so far, its torchrun restart count."""
        if slot.actor is None:
            slot.name = f"{self.cfg.job.name}-{slot.worker_id}-r{slot.rank}"
            slot.actor = self._new_actor(slot.node, f"{slot.worker_id}-r{slot.rank}")
        else:
            self._stack.callback(self._release_actor, slot.actor)
        ctx = self._context(run, slot, generation, restore, restarts)
        args = ({"argv": list(self.cfg.job.argv)} if is_script(self.entrypoint)
                else dict(self.cfg.job.args))
        return slot.actor.run.remote(ctx.to_env(), args,
                                     str(run.log_path(f"rank_{slot.rank}_{slot.worker_id}")))

    def _rank_nodes(self) -> list[int]:
        """The node of every rank: where it runs, or will (before the workers start)."""
        if self._slots:
            return [slot.node for slot in self._slots.values()]
        return [rank % self.cfg.job.nodes for rank in range(self.cfg.job.world_size)]

    def _start_workers(self, run: RunDir) -> dict[int, RankSlot]:
        slots = {}
        for rank in range(self.cfg.job.world_size):
            node = rank % self.cfg.job.nodes
            slot = RankSlot(rank, f"w{rank}-g0", node, self._new_actor(node, f"rank{rank}"),
                            name=f"{self.cfg.job.name}-rank{rank}")
            slots[rank] = slot
        self._slots = slots
        restore = None if self.resume_point is None else self.resume_point.restore_for(self.cfg)
        for slot in slots.values():
            slot.ref = self._launch(run, slot, 0, restore)
        return slots

    def _watch(self, run: RunDir, slots: dict[int, RankSlot],
               coordinator: RecoveryCoordinator) -> dict[int, Any]:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.job.timeout_s
        total = cfg.job.args.get("steps") if isinstance(cfg.job.args.get("steps"), int) else None
        view = ProgressView(self.console, cfg.job.world_size, total).start()
        watch = self._node_watch(coordinator)
        if watch is not None:
            coordinator.silent = watch.silent
        monitor = Monitor(cfg.job.nodes, watch=watch,
                          collective_grace_s=cfg.detection.collective_grace_s,
                          on_exception=cfg.recovery.on_worker_exception,
                          replicated_state=cfg.detection.replicated_state,
                          report_stale_s=REPORT_STALE_BEATS * cfg.etcd.heartbeat_s)
        injector = None if self.drills is None else self.drills.injector(
            cfg, run.path, slots, coordinator, self.services, self._remove_node)
        observer = RunObserver(coordinator.events, lambda g: coordinator.holders_before.get(g, {}))
        factor = cfg.replication.copies
        commits = CommitTracker(self.services.membership, cfg.job.world_size, factor,
                                cfg.replication.commit_every_steps,
                                keepers=lambda: [addr for _, addr in self.keepers.values()])
        coordinator.committed = lambda: commits.committed
        stall = StallDetector(cfg.detection.stall_timeout_s)
        outage = EtcdOutage(self.services.membership, coordinator.events.emit,
                            outage_grace_s(cfg.etcd.lease_ttl_s), on_untrusted=stall.reset,
                            min_interval_s=cfg.etcd.heartbeat_s / 2)
        restarts = KeeperRestarts(cfg, self.keepers, coordinator, slots, monitor.watch,
                                  self.secret_hex, self.services.etcd_endpoints,
                                  lambda actor: self._stack.callback(self._close_keeper, actor))
        keeper_events = KeeperEvents(self.keepers, coordinator.events, self.console)
        results: dict[int, Any] = {}
        self._publish_state(run, slots, coordinator)
        try:
            while len(results) < cfg.job.world_size:
                if self._stop_signal is not None:   # its KeyboardInterrupt went missing
                    raise KeyboardInterrupt(f"signal {self._stop_signal}")
                self._check_leadership()
                # every poll while a recovery or a drill fault is pending; otherwise
                # twice a heartbeat, the rate the keepers rewrite the records
                members = outage.members(fresh=coordinator.pending is not None or (
                    injector is not None and injector.waiting))
                polled = monitor.poll(slots, set(results), members,
                                      timeout_s=cfg.detection.poll_interval_s,
                                      finished=self._finished_workers,
                                      leases_trusted=outage.trusted())
                results.update(polled.finished)
                for sample in polled.progress:
                    if sample.step > 0:  # setting up the first step is not a stall
                        stall.observe(sample)
                faults = coordinator.fresh(self._classify(polled, slots, coordinator, stall))
                self._first_step_seen = self._first_step_seen or any(
                    m.step >= 1 for m in members.values() if m.rank >= 0)
                self._session_seen = self._session_seen or any(
                    m.rank >= 0 for m in members.values())
                if not self._first_step_seen and not self._session_seen:
                    self._first_step_seen = self._scripts_formed_group()
                if faults and not self._first_step_seen and any(
                        f.kind in NODE_LOSS_KINDS for f in faults):
                    self._check_startup_nodes(faults[0].evidence, wait_s=self._ray_death_s())
                if faults and results:     # a finished rank cannot join a new group
                    faults = _after_finish(faults, results, slots, self._finished_step)
                if faults:
                    if not cfg.recovery.enabled:
                        raise PlanInfeasible(f"recovery is disabled: {faults[0].evidence}")
                    coordinator.recover(faults, slots)
                    stall.reset()
                coordinator.retry(slots)
                coordinator.check_resumed(members)
                coordinator.check_rejoined(members, set(results), monitor.last_seen,
                                           sessionless=not self._session_seen)
                self._publish_state(run, slots, coordinator)
                commits.poll(table=outage.last if outage.trusted() else None)
                if injector is not None:
                    injector.poll(members)
                observer.poll(members, {slot.worker_id for slot in slots.values()})
                if coordinator.pool is not None and coordinator.pending is None:
                    lost = coordinator.pool.check(coordinator.live_nodes)
                    if lost:
                        coordinator.events.emit("spare_lost", spares=lost)
                view.update(members)
                keeper_events.poll(coordinator.live_nodes, time.monotonic())
                restarts.poll()
                self._observe(members, coordinator, commits)
                if time.monotonic() > deadline:
                    raise JobTimeout(f"job {cfg.job.name} ran past job.timeout_s="
                                     f"{cfg.job.timeout_s}")
            if cfg.snapshot.enabled and (cfg.tiers.disk.enabled or cfg.tiers.s3.enabled):
                commits.settle(3 * cfg.etcd.heartbeat_s)   # the tiers commit the last step
                self._settle_keeper_tiers(coordinator.live_nodes)
        finally:
            if injector is not None:
                injector.close()
            view.close()
            keeper_events.drain(coordinator.live_nodes, KEEPER_EVENTS_FINAL_WAIT_S)
        return {rank: results[rank] for rank in sorted(results)}

    def _settle_keeper_tiers(self, live: set[int]) -> None:
        """A finished job's live keepers write their last tier markers and stop persisting,
        so the final drain of keeper events sees them (bounded: a keeper's close would
        wait as long for its persister)."""
        refs = [self.keepers[node][0].settle_tiers.remote() for node in sorted(live)
                if node in self.keepers]
        try:
            ray.get(refs, timeout=SETTLE_TIERS_S)
        except ray.exceptions.RayError as exc:   # timed out, or a keeper died as it ended
            log.warning("event=keeper_tiers_settle_failed error=%s", str(exc)[:300])

    def _node_watch(self, coordinator: RecoveryCoordinator) -> NodeWatch | None:
        """Watch every keeper's connection, so a lost node is noticed in milliseconds."""
        if not self.keepers or not self.cfg.detection.watch_keepers:
            return None
        watch = NodeWatch({n: k[1] for n, k in self.keepers.items()},
                          raylet_addresses(self.cfg.job.nodes), bytes.fromhex(self.secret_hex),
                          self.cfg.job.name, lambda: coordinator.generation)
        self._stack.callback(watch.close)
        return watch.start()

    def _check_leadership(self) -> None:
        """Raise ``LeadershipLost`` once the coordinator lease is gone and a standby may
        lead. Without a standby (``coordinator.standby: false``) nobody else can: a lapsed
        lease (etcd slow, this process starved) is taken again and the job goes on."""
        leadership = self.services.leadership
        try:
            leadership.check()
        except LeadershipLost as exc:
            if self.cfg.coordinator.standby or not leadership.try_acquire():
                raise
            log.warning("event=coordinator_lease_renewed after=%r", str(exc)[:200])

    def _lost_leadership(self) -> bool:
        """With a standby configured: whether this launcher's coordinator lease is gone (or
        etcd stopped confirming it), so a failure seen now (a recovery that could not
        reach etcd) is the standby's to handle rather than a reason to tear the job down."""
        if not self.cfg.coordinator.standby:
            return False
        try:
            self.services.leadership.check()
        except LeadershipLost:
            return True
        except PhalanxError as exc:       # etcd unreachable from here: judged as before
            log.warning("event=leadership_check_failed error=%s", exc)
        return not self.services.leadership.held

    def _finished_step(self, worker_id: str) -> int:
        """The step a worker that left on purpose returned at (-1: unknown)."""
        try:
            kv = self.services.membership.get(f"{FINISHED_PREFIX}{worker_id}")
            return int(kv.value) if kv is not None else -1
        except (PhalanxError, ValueError):
            return -1

    def _finished_workers(self) -> set[str]:
        """Workers that left membership on purpose (their entrypoint returned)."""
        return {kv.key.removeprefix(FINISHED_PREFIX)
                for kv in self.services.membership.list_prefix(FINISHED_PREFIX)}

    def _remove_node(self, index: int) -> None:
        """A drill's node loss on the local Ray: the node's processes die at once, and its
        keeper's shared memory, which a lost machine takes with it, is unlinked here."""
        if self.services.local_ray is None:
            raise ConfigError("drills.scenario", "kill_node needs the embedded local Ray",
                              "drill node loss against the embedded cluster (ray.address "
                              "empty)")
        self.services.local_ray.remove_node(index)
        removed = remove_stale(self.cfg.snapshot.shm_dir,
                               shm_prefix(self.cfg.job.name, node_name(index)))
        log.info("event=node_memory_released node=%s files=%d", node_name(index), len(removed))

    def _classify(self, polled: PollResult, slots: dict[int, RankSlot],
                  coordinator: RecoveryCoordinator, stall: StallDetector) -> list[FaultReport]:
        world = WorldView(
            generation=Generation(coordinator.generation), world_size=self.cfg.job.world_size,
            rank_workers={Rank(r): WorkerId(s.worker_id) for r, s in slots.items()},
            worker_nodes={WorkerId(s.worker_id): node_name(s.node) for s in slots.values()},
            live_nodes=frozenset(node_name(n) for n in coordinator.live_nodes),
            committed_step=Step(-1))
        now = time.monotonic()
        live = {node_name(n) for n in coordinator.live_nodes}
        recovering = coordinator.pending is not None or coordinator.waiting is not None
        signals = [s for s in polled.signals
                   if not _stale(s, live, coordinator.generation, recovering)]
        signals += self._signals_at_start       # workers a standby found gone at takeover
        self._signals_at_start = []
        faults = classify(signals, world, now)
        if not faults and coordinator.pending is None and coordinator.waiting is None:
            faults = stall.check(now)     # (ranks waiting for a parked plan are not hung)
        return faults


def _after_finish(faults: list[FaultReport], results: Mapping[int, Any],
                  slots: Mapping[int, RankSlot],
                  step_of: Callable[[str], int]) -> list[FaultReport]:
    """``faults`` once some rank returned: those about finished ranks only are dropped
    (their work is done); any other raises ``FaultAfterFinish`` at once, naming the step
    each finished rank returned at (``step_of(worker)``)."""
    left = unfinished_faults(faults, set(results))
    if not left:
        return []
    raise fault_after_finish(left, {rank: step_of(slots[rank].worker_id) for rank in results})


def _stale(signal: Any, live: AbstractSet[str], generation: int, recovering: bool) -> bool:
    """A signal about a node already handled, or a failed collective that a recovery in
    progress (or parked) or an older generation explains."""
    if isinstance(signal, (NodeLost, KeeperLeaseExpired)):
        return signal.node not in live
    return isinstance(signal, CollectiveError) and (recovering or signal.generation < generation)


def plan_timeout_s(cfg: PhalanxConfig) -> float:
    """How long a survivor waits for the next generation's plan: longer than any recovery
    the coordinator may park (``spares.on_exhausted: wait``)."""
    waits = cfg.spares.wait_timeout_s if cfg.spares.on_exhausted == "wait" else 0.0
    return max(DEFAULT_PLAN_TIMEOUT_S, waits + DEFAULT_PLAN_TIMEOUT_S / 2)


def job_secret(cfg: PhalanxConfig, run: RunDir) -> bytes:
    """The job secret (HMAC of manifests, peer auth): ``security.secret_file``'s bytes, or a
    fresh random one kept in the run directory (mode 0600) for ``phalanx ckpt verify``."""
    configured = read_job_secret(cfg)
    if configured is not None:
        return configured
    path = run.path / "secret"
    if path.exists():     # a standby carrying on the run its leader started
        return path.read_bytes().rstrip(b"\n")
    secret = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret + b"\n")
    return secret


def _close_keepers(actors: Sequence[Any]) -> None:
    """Let the keepers unlink their shared memory, all at once (closed one after another,
    each took its own 0.3-0.5 s of every launch's teardown), then stop their processes."""
    refs = []
    for actor in actors:
        with contextlib.suppress(Exception):  # teardown: the keeper may already be gone
            refs.append(actor.close.remote())
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=KEEPER_CLOSE_S)
    for actor in actors:
        _kill_actor(actor)


def _kill_actor(actor: Any) -> None:
    with contextlib.suppress(Exception):  # teardown: the actor may already be gone
        ray.kill(actor, no_restart=True)


def _install_stop_signals(stack: contextlib.ExitStack, on_signal: Callable[[int], None]) -> None:
    """SIGTERM unwinds like Ctrl-C, so every service is stopped; both are also handed to
    ``on_signal``, and the watch loop raises again at its next poll. A ``KeyboardInterrupt``
    raised while Ray's ``wait`` checks for signals can be lost in it: a launcher once
    polled on for a minute after SIGINT, its main thread in ``Monitor.poll``'s
    ``ray.wait``. Installed again once Ray runs, so Ray's own SIGINT handling, if it set
    one, is not the one in force."""
    def on_stop(signum: int, frame: object) -> None:
        on_signal(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.signal(signum, on_stop)
        except ValueError:  # not the main thread: leave signals to the caller
            return
        stack.callback(signal.signal, signum, previous)


def assign_local_rank(slots: Mapping[int, RankSlot], slot: RankSlot) -> int:
    """torchrun's LOCAL_RANK for ``slot`` (recorded on it): its index among its node's
    processes. A first rank takes the count of ranks launched on its node before it; a
    replacement the lowest index no other live rank on that node holds (a spare promoted
    onto a node whose ranks all live gets the next one, as its own device would be)."""
    taken = {other.local_rank for other in slots.values()
             if other.node == slot.node and other.rank != slot.rank and other.local_rank >= 0}
    slot.local_rank = next(i for i in range(len(taken) + 1) if i not in taken)
    return slot.local_rank


def local_world_size(slots: Mapping[int, RankSlot], slot: RankSlot) -> int:
    """torchrun's LOCAL_WORLD_SIZE for ``slot``: how many ranks its node runs with it."""
    return sum(1 for other in slots.values()
               if other.node == slot.node and other.rank != slot.rank) + 1
