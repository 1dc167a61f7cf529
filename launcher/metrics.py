"""The launcher's Prometheus endpoint (``metrics.port``): job progress, recoveries and their
phases, snapshot cost, replication lag, keeper memory, tier persistence and spares, in a
registry of its own, fed by the watch loop (``observe_*``) and the job's events (``on_event``).

Label cardinality is bounded by nodes, tiers, phases and fault kinds; only
``metrics.per_rank`` adds a ``rank`` label (at most ``METRICS_PER_RANK_MAX`` ranks).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import MetricsConfig
from phalanx.launcher.goodput import Goodput
from phalanx.recovery.base import FaultKind
from phalanx.recovery.phases import Phase
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.commit import KeeperReport

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0       # steps/s is measured over this much of the recent past
UPDATE_EVERY_S = 0.5       # the watch loop refreshes the gauges at most this often
GOODPUT_EVERY_S = 5.0      # ... and the goodput breakdown (a pass over the events) this often
RANK_STATES = ("running", "finished", "absent")
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0)
PERSIST_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0)
# keeper events that mean a step did not (yet) reach a tier -> the failure's ``kind`` label
TIER_FAILURES = {"tier_degraded": "degraded", "tier_skipped": "skipped",
                 "tier_commit_abandoned": "commit_abandoned", "persister_error": "error"}
# a recovery's ``phases_s`` keys: "detect" (fault observed -> handled), then each phase's time
RECOVERY_PHASES = ("detect", *(p.value for p in Phase if p not in (Phase.STEADY, Phase.FAILED)))


def current_ranks(members: Mapping[str, MemberRecord]) -> dict[int, MemberRecord]:
    """Each training rank's newest record (highest generation, then newest heartbeat): a
    replaced worker's record can linger until its lease expires. Keepers (rank -1) are
    left out."""
    ranks: dict[int, MemberRecord] = {}
    for record in members.values():
        if record.rank < 0:
            continue
        held = ranks.get(record.rank)
        if held is None or (record.generation, _beat(record)) > (held.generation, _beat(held)):
            ranks[record.rank] = record
    return ranks


def _beat(record: MemberRecord) -> float:
    value = record.extra.get("time")
    return float(value) if isinstance(value, (int, float)) else 0.0


def replication_lag(reports: Mapping[str, KeeperReport], copies: int) -> dict[str, tuple[int, int]]:
    """node -> (steps, bytes) its own ranks' snapshots are ahead of their newest replica.

    Per rank whose local copies the node holds: newest local step minus the newest step of
    that rank held as a replica by any other keeper (-1 when none holds one yet); the
    node's steps are the largest of its ranks', its bytes the sum over its ranks of lag
    steps x the node's bytes per snapshot copy (``bytes_held`` plus ``bytes_shared``, over
    the copies held: reports carry no per-rank sizes). 0 for every node when replication
    is off (``copies`` 0)."""
    newest_replica: dict[int, dict[str, int]] = {}       # rank -> holder -> newest step
    for node, report in reports.items():
        for rank, steps in report.replicas.items():
            if steps:
                newest_replica.setdefault(rank, {})[node] = max(steps)
    lag: dict[str, tuple[int, int]] = {}
    for node, report in reports.items():
        held = sum(len(s) for s in report.local.values()) + sum(
            len(s) for s in report.replicas.values())
        per_copy = (report.bytes_held + report.bytes_shared) // held if held else 0
        worst, total = 0, 0
        for rank, steps in report.local.items():
            if not steps or copies <= 0:
                continue
            elsewhere = max((step for holder, step in newest_replica.get(rank, {}).items()
                             if holder != node), default=-1)
            behind = max(0, max(steps) - elsewhere)
            worst, total = max(worst, behind), total + behind * per_copy
        lag[node] = (worst, total)
    return lag


class JobMetrics:
    """Owns the registry and, after ``start()``, the HTTP server thread that serves it at
    ``http://<metrics.host>:<metrics.port>/metrics`` until ``close()``.

    ``observe_*`` are called by the launcher's watch loop (its thread), ``on_event`` by
    ``EventLog`` on whichever thread emits; prometheus_client's metrics are thread-safe.
    ``start`` raises ``ConfigError`` (key ``metrics.port``) when the port cannot be bound.
    """

    def __init__(self, cfg: MetricsConfig, world_size: int, tiers: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._cfg, self._world_size = cfg, world_size
        self._clock, self._wall_clock = clock, wall_clock
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._next_update = 0.0
        self._next_goodput = 0.0
        self._steps: collections.deque[tuple[float, int]] = collections.deque()
        self._snapshot_seen: dict[str, tuple[float, int]] = {}  # worker -> (stall_s, captures)
        self._nodes: set[str] = set()
        self.registry = CollectorRegistry()
        self._define()
        self._initialise(tiers)

    def _define(self) -> None:
        def gauge(name: str, text: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, text, labels, registry=self.registry)

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, labels, registry=self.registry)

        def histogram(name: str, text: str, labels: tuple[str, ...],
                      buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, labels, registry=self.registry, buckets=buckets)

        self.world_size = gauge("phalanx_world_size", "Training ranks of the job")
        self.job_step = gauge("phalanx_job_step", "Steps completed by the slowest rank")
        self.job_step_max = gauge("phalanx_job_step_max", "Steps completed by the fastest rank")
        self.steps_per_second = gauge("phalanx_job_steps_per_second",
                                      f"Job steps per second over the last {RATE_WINDOW_S:.0f} s")
        self.generation = gauge("phalanx_generation", "The job's generation (fencing token)")
        self.committed_step = gauge("phalanx_committed_step",
                                    "Newest step committed job-wide (-1: none yet)")
        self.live_nodes = gauge("phalanx_live_nodes", "Nodes the coordinator counts as alive")
        self.ranks = gauge("phalanx_ranks", "Ranks by state of their member record", ("state",))
        self.heartbeat_age = gauge("phalanx_heartbeat_age_seconds_max",
                                   "Oldest running rank's member-record age")
        self.recoveries = counter("phalanx_recoveries", "Completed recoveries by root fault",
                                  ("fault",))
        self.recovery_seconds = histogram("phalanx_recovery_seconds",
                                          "Fault to first step of the new generation", (),
                                          RECOVERY_BUCKETS)
        self.phase_seconds = histogram("phalanx_recovery_phase_seconds",
                                       "Duration of each recovery phase", ("phase",),
                                       PHASE_BUCKETS)
        self.lost_steps = counter("phalanx_lost_steps", "Steps recomputed after recoveries")
        self.snapshot_stall = counter("phalanx_snapshot_stall_seconds",
                                      "Training-thread time blocked by snapshot capture, "
                                      "summed over ranks")
        self.snapshot_captures = counter("phalanx_snapshot_captures",
                                         "Snapshots published, summed over ranks")
        self.snapshot_interval = gauge("phalanx_snapshot_interval_steps",
                                       "Snapshot interval in force (largest over ranks)")
        self.lag_steps = gauge("phalanx_replication_lag_steps",
                               "Steps a node's own snapshots are ahead of their replicas",
                               ("node",))
        self.lag_bytes = gauge("phalanx_replication_lag_bytes",
                               "Bytes of a node's own snapshots not yet replicated (estimate)",
                               ("node",))
        self.shm_held = gauge("phalanx_shm_held_bytes",
                              "Shared memory (tmpfs pages) a node's keeper holds: own slots and replicas",
                              ("node",))
        self.persist_seconds = histogram("phalanx_tier_persist_seconds",
                                         "One node's write of one step to a tier", ("tier",),
                                         PERSIST_BUCKETS)
        self.persist_bytes = counter("phalanx_tier_persisted_bytes", "Bytes written to a tier",
                                     ("tier",))
        self.persist_failures = counter("phalanx_tier_persist_failures",
                                        "Tier writes or commits that failed, by kind",
                                        ("tier", "kind"))
        self.tier_committed = gauge("phalanx_tier_committed_step",
                                    "Newest step complete in a tier (-1: none yet)", ("tier",))
        self.spares = gauge("phalanx_spares", "Warm spares by state", ("state",))
        self.goodput_ratio = gauge("phalanx_goodput_ratio",
                                   "Effective training time: productive seconds / wall seconds")
        self.goodput_seconds = gauge("phalanx_goodput_seconds",
                                     "Wall time of the run so far by part (they sum to the wall "
                                     "time; recovery phases as recovery_<phase>)", ("part",))
        self.rank_step: Gauge | None = None
        self.rank_heartbeat: Gauge | None = None
        if self._cfg.per_rank:
            self.rank_step = gauge("phalanx_rank_step", "Steps completed by a rank", ("rank",))
            self.rank_heartbeat = gauge("phalanx_rank_heartbeat_age_seconds",
                                        "Age of a rank's member record", ("rank",))

    def _initialise(self, tiers: Iterable[str]) -> None:
        """Every series a job can have with a known label set starts at zero, so that
        ``rate``/``increase`` see the first event."""
        self.world_size.set(self._world_size)
        self.committed_step.set(-1)
        for fault in FaultKind:
            self.recoveries.labels(fault=fault.value)
        for phase in RECOVERY_PHASES:
            self.phase_seconds.labels(phase=phase)
        for state in RANK_STATES:
            self.ranks.labels(state=state)
        self.ranks.labels(state="absent").set(self._world_size)
        for state in ("ready", "starting"):
            self.spares.labels(state=state)
        for tier in tiers:
            self.persist_seconds.labels(tier=tier)
            self.persist_bytes.labels(tier=tier)
            self.tier_committed.labels(tier=tier).set(-1)
            for kind in TIER_FAILURES.values():
                self.persist_failures.labels(tier=tier, kind=kind)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "JobMetrics":
        host, port = self._cfg.host, self._cfg.port
        try:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise ConfigError("metrics.port", f"cannot listen on {host}:{port}: {exc}",
                              "choose a free port, or 0 to turn the endpoint off") from exc
        log.info("event=metrics_listening host=%s port=%d", host, self.port)
        return self

    @property
    def port(self) -> int:
        """The port the endpoint listens on (0 before ``start``)."""
        return int(self._server.server_address[1]) if self._server is not None else 0

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "JobMetrics":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the watch loop ----------------------------------------------------------------
    def due(self, now: float | None = None) -> bool:
        """Whether the gauges are due a refresh (at most every ``UPDATE_EVERY_S``)."""
        now = self._clock() if now is None else now
        if now < self._next_update:
            return False
        self._next_update = now + UPDATE_EVERY_S
        return True

    def goodput_due(self, now: float | None = None) -> bool:
        """Whether the goodput breakdown is due (at most every ``GOODPUT_EVERY_S``)."""
        now = self._clock() if now is None else now
        if now < self._next_goodput:
            return False
        self._next_goodput = now + GOODPUT_EVERY_S
        return True

    def observe_goodput(self, goodput: Goodput) -> None:
        """The run's wall-time accounting so far (``phalanx.launcher.goodput``)."""
        self.goodput_ratio.set(goodput.effective)
        for part, seconds in goodput.parts().items():
            self.goodput_seconds.labels(part=part.replace(".", "_")).set(seconds)

    def observe_members(self, members: Mapping[str, MemberRecord]) -> None:
        """Progress, heartbeat age and snapshot cost from the member table."""
        now, wall = self._clock(), self._wall_clock()
        ranks = current_ranks(members)
        states = dict.fromkeys(RANK_STATES, 0)
        oldest, interval = 0.0, 0
        for rank, record in ranks.items():
            state = record.extra.get("state")
            states["finished" if state == "finished" else "running"] += 1
            age = max(0.0, wall - _beat(record)) if _beat(record) else 0.0
            if state != "finished":
                oldest = max(oldest, age)
            if self.rank_step is not None and self.rank_heartbeat is not None:
                self.rank_step.labels(rank=str(rank)).set(record.step)
                self.rank_heartbeat.labels(rank=str(rank)).set(age)
            interval = max(interval, self._snapshot(record))
        states["absent"] = max(0, self._world_size - len(ranks))
        for state, count in states.items():
            self.ranks.labels(state=state).set(count)
        self.heartbeat_age.set(oldest)
        if interval:
            self.snapshot_interval.set(interval)
        if ranks:
            steps = [r.step for r in ranks.values()]
            self.job_step.set(min(steps))
            self.job_step_max.set(max(steps))
            self.steps_per_second.set(self._rate(now, min(steps)))

    def _snapshot(self, record: MemberRecord) -> int:
        """Count what ``record``'s snapshots cost since its last report; returns its
        interval (0: none reported)."""
        info = record.extra.get("snapshot")
        if not isinstance(info, dict):
            return 0
        stall, captures = float(info.get("stall_s") or 0.0), int(info.get("captures") or 0)
        seen_stall, seen_captures = self._snapshot_seen.get(record.worker_id, (0.0, 0))
        if stall > seen_stall:
            self.snapshot_stall.inc(stall - seen_stall)
        if captures > seen_captures:
            self.snapshot_captures.inc(captures - seen_captures)
        self._snapshot_seen[record.worker_id] = (max(stall, seen_stall),
                                                 max(captures, seen_captures))
        return int(info.get("every_steps") or 0)

    def _rate(self, now: float, step: int) -> float:
        """Steps per second of the slowest rank over ``RATE_WINDOW_S``; a rollback (the
        step moved back) starts the window again."""
        samples = self._steps
        if samples and step < samples[-1][1]:
            samples.clear()
        samples.append((now, step))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        (first_at, first), (last_at, last) = samples[0], samples[-1]
        return (last - first) / (last_at - first_at) if last_at > first_at else 0.0

    def observe_job(self, generation: int, committed: int, live_nodes: int) -> None:
        self.generation.set(generation)
        self.committed_step.set(committed)
        self.live_nodes.set(live_nodes)

    def observe_reports(self, reports: Mapping[str, KeeperReport], copies: int) -> None:
        """Keeper memory and replication lag per node; a node whose report is gone (its
        keeper lost with the node) loses its series."""
        lag = replication_lag(reports, copies)
        for node in self._nodes - set(reports):
            for metric in (self.lag_steps, self.lag_bytes, self.shm_held):
                metric.remove(node)
        self._nodes = set(reports)
        for node, report in reports.items():
            steps, nbytes = lag[node]
            self.lag_steps.labels(node=node).set(steps)
            self.lag_bytes.labels(node=node).set(nbytes)
            self.shm_held.labels(node=node).set(report.bytes_held)

    def observe_spares(self, ready: int, starting: int) -> None:
        self.spares.labels(state="ready").set(ready)
        self.spares.labels(state="starting").set(starting)

    # -- events ------------------------------------------------------------------------
    def on_event(self, record: Mapping[str, Any]) -> None:
        """An ``EventLog`` listener: recoveries, their phases and lost steps, tier writes
        and tier failures."""
        event = record.get("event")
        if event == "recovered":
            self.recoveries.labels(fault=str(record.get("fault"))).inc()
            self.recovery_seconds.observe(float(record.get("fault_to_first_step_s") or 0.0))
            for phase, seconds in dict(record.get("phases_s") or {}).items():
                self.phase_seconds.labels(phase=str(phase)).observe(float(seconds))
            self.lost_steps.inc(max(0, int(record.get("lost_steps") or 0)))
            self.generation.set(int(record.get("generation") or 0))
        elif event == "tier_persisted":
            tier = str(record.get("tier"))
            self.persist_seconds.labels(tier=tier).observe(float(record.get("seconds") or 0.0))
            self.persist_bytes.labels(tier=tier).inc(max(0, int(record.get("bytes") or 0)))
        elif event == "tier_committed":
            self.tier_committed.labels(tier=str(record.get("tier"))).set(
                int(record.get("step", -1)))
        elif event in TIER_FAILURES:
            self.persist_failures.labels(tier=str(record.get("tier") or "unknown"),
                                         kind=TIER_FAILURES[str(event)]).inc()
