"""Turns what the launcher observes each poll into detection signals: finished or failed
worker calls (Ray), vanished member leases (etcd), dead Ray nodes, and progress samples."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from phalanx.configs.errors import ReplicasNeverAgreed, WorkerFailed
from phalanx.launcher.coordination.coordinator import RankSlot
from phalanx.runtime.base import node_index, node_name
from phalanx.launcher.coordination.node_watch import NodeWatch
from phalanx.launcher.services.ray_cluster import node_indices
from phalanx.launcher.coordination.replica_check import ReplicaCheck
from phalanx.recovery.detection import (ActorDied, CollectiveError, LeaseLost, NodeLost, Progress,
                                        Signal, WorkerRaised)
from phalanx.runtime.base import REPORT_REVISION, MemberRecord, Rank, Step, WorkerId
from phalanx.runtime.keeper.memory_plan import MemoryPlanExceeded

log = logging.getLogger(__name__)
FINISH_GRACE_S = 0.5
AWAY_PROBE_S = 1.0      # how often a node whose keeper's record is away is probed again
# Once one rank's call ends, the others that end within this are gathered into the same
# poll: ranks killed together reached this launcher 4, 13 and 45 ms apart in the
# spare_exhausted drill (kills 7 ms apart), so most are planned as one fault; a later one
# is planned after, and a replacement still joining follows the newer plan.
SETTLE_S = 0.02
# What a worker raised that a replacement would raise too (its node's shared memory cannot
# hold the job's snapshots; the ranks never started from the same state): the job fails at
# once, naming it.
NOT_RECOVERABLE = (f"{MemoryPlanExceeded.__name__}:", f"{ReplicasNeverAgreed.__name__}:")


@dataclass
class PollResult:
    signals: list[Signal] = field(default_factory=list)
    finished: dict[int, Any] = field(default_factory=dict)
    progress: list[Progress] = field(default_factory=list)


class Monitor:
    """Owned by the launcher's main thread."""

    def __init__(self, nodes: int, node_check_s: float = 0.25,
                 watch: NodeWatch | None = None, collective_grace_s: float = 2.0,
                 on_exception: str = "replace",
                 replicated_state: Sequence[str] = ("model", "optimizer"),
                 report_stale_s: float = 1.5) -> None:
        self._nodes = nodes
        self._report_stale_s = report_stale_s
        self._reports: dict[str, tuple[int, float]] = {}   # node -> (revision, first seen)
        self._on_exception = on_exception
        self._raised_at: set[tuple[int, int]] = set()   # (rank, step) that raised once
        self._reported: set[Any] = set()      # calls already reported as raised or dead
        self._watch = watch
        self._collective_grace_s = collective_grace_s
        self._collective: dict[tuple[str, int], float] = {}  # (worker, generation) → seen
        self._node_check_s = node_check_s
        self._last_node_check = 0.0
        self._seen: dict[str, MemberRecord] = {}
        self._vanished: dict[str, float] = {}
        self._dead_nodes: set[int] = set()
        self._keepers_seen: set[int] = set()     # nodes whose keeper's record was present
        self._away: dict[int, float] = {}   # node whose record lapsed but answers -> probed at
        self._replicas = ReplicaCheck(replicated_state)

    def poll(self, slots: Mapping[int, RankSlot], done_ranks: set[int],
             members: Mapping[str, MemberRecord], timeout_s: float,
             finished: Callable[[], set[str]] = set, leases_trusted: bool = True) -> PollResult:
        """One poll. ``leases_trusted`` False (etcd unreachable or just back): a vanished
        member key is no signal yet; its timer starts once keys are trusted again."""
        result = PollResult()
        active = {slot.ref: slot for rank, slot in slots.items()
                  if rank not in done_ranks and slot.ref is not None
                  and slot.ref not in self._reported}
        ready: list[Any] = []
        if active:      # back at the first call that ends (a death), then every one that
            # ended with it: waiting for them all held a death back for the rest of timeout_s
            ready, _ = ray.wait(list(active), num_returns=1, timeout=timeout_s)
            if ready and len(active) > 1:
                ready, _ = ray.wait(list(active), num_returns=len(active), timeout=SETTLE_S)
        now = time.monotonic()
        for ref in ready:
            slot = active[ref]
            try:
                result.finished[slot.rank] = ray.get(ref)
            except RayTaskError as exc:
                self._reported.add(ref)
                result.signals.append(self._raised(_worker_error(exc, slot.rank), slot,
                                                   members, now))
            except RayActorError as exc:
                self._reported.add(ref)      # reported once; ``wait`` skips it after
                result.signals.append(ActorDied(WorkerId(slot.worker_id), now,
                                                str(exc).splitlines()[0]))
        done = done_ranks | set(result.finished)
        self._silent_nodes(slots, done, members, now, result, leases_trusted)
        self._lease_signals(slots, done, members, now, result, finished, leases_trusted)
        self._node_signals(now, result)
        self._away_progress(slots, done, members, now, result)
        for record in members.values():
            if record.rank >= 0 and slots.get(record.rank) and \
                    slots[record.rank].worker_id == record.worker_id:
                fresh = self._current(record, now)
                result.progress.append(Progress(
                    Rank(record.rank), Step(record.step), now,
                    # a record its keeper could not refresh says nothing about the rank
                    in_step=fresh and bool(record.extra.get("in_step", True)),
                    busy=bool(record.extra.get("busy")),
                    step_s=float(record.extra.get("step_s") or 0.0)))
                self._collective_signal(record, now, result)
        current = [r for r in members.values() if r.rank >= 0 and slots.get(r.rank)
                   and slots[r.rank].worker_id == r.worker_id]
        corruption = self._replicas.poll(current, len(slots), now)
        if corruption is not None:
            result.signals.append(corruption)
        return result

    def _current(self, record: MemberRecord, now: float) -> bool:
        """Is this record current? A record relayed by its node keeper is as current as the
        keeper's report, which is rewritten every heartbeat: a report revision that has not
        moved for ``report_stale_s`` (the keeper cannot reach etcd: a member failing over,
        a leader election) excuses the node's ranks from the stall detector until it moves,
        since a record standing still there is no rank standing still."""
        revision = record.extra.get(REPORT_REVISION)
        if not isinstance(revision, int):
            return True
        seen = self._reports.get(record.node)
        if seen is None or seen[0] != revision:
            self._reports[record.node] = (revision, now)
            return True
        return now - seen[1] < self._report_stale_s

    def _raised(self, error: WorkerFailed, slot: RankSlot,
                members: Mapping[str, MemberRecord], now: float) -> WorkerRaised:
        """A rank whose entrypoint raised becomes a fault to recover from, unless
        ``recovery.on_worker_exception`` is fail, it raised at this step before (a bug
        that replays, not a fault), or it raised before it ever joined the job (its
        script's set-up failed: an import, its arguments, a port; a replacement would fail
        the same way): then the job fails with the worker's own traceback. A rank that
        raised leaves etcd as its session closes, often before its call's error reaches
        this poll: its last record seen tells that it joined (the ``mixed`` drill's
        injected exception once failed a CI run as "never joined" that way).

        A rank with no Session whose collective had failed first (``peer_failure``: a
        peer died or left) raised because of that peer's fault, as plain gloo raises
        under torchrun: it is restarted with the others, never the job's failure."""
        record = members.get(slot.worker_id) or self._seen.get(slot.worker_id)
        if record is None and error.peer_failure:
            log.warning("event=worker_raised_after_peer_failure rank=%d worker=%s "
                        "group_fault=%r", slot.rank, slot.worker_id, error.peer_failure[:300])
            return WorkerRaised(Rank(slot.rank), f"{error.message}\n{error.traceback_text}\n"
                                f"raised after its group failed: {error.peer_failure[:200]}",
                                now)
        key = (slot.rank, record.step if record is not None else -1)
        if self._on_exception == "fail" or key in self._raised_at or record is None \
                or error.message.startswith(NOT_RECOVERABLE):
            raise error
        self._raised_at.add(key)
        return WorkerRaised(Rank(slot.rank), f"{error.message}\n{error.traceback_text}", now)

    def _collective_signal(self, record: MemberRecord, now: float, result: PollResult) -> None:
        """A rank that reports its group failed in its current generation, still so after
        ``collective_grace_s`` (a recovery would have moved it on), is a signal."""
        error = record.extra.get("collective_error")
        if not isinstance(error, dict) or error.get("generation") != record.generation:
            return
        key = (record.worker_id, record.generation)
        first = self._collective.setdefault(key, now)
        if first >= 0 and now - first >= self._collective_grace_s:
            self._collective[key] = -1.0       # reported once
            result.signals.append(CollectiveError(Rank(record.rank), first,
                                                  str(error.get("detail")), record.generation))

    def _lease_signals(self, slots: Mapping[int, RankSlot], done: set[int],
                       members: Mapping[str, MemberRecord], now: float, result: PollResult,
                       finished: Callable[[], set[str]], trusted: bool = True) -> None:
        """A worker whose member key vanished while its call still runs lost its lease (a
        frozen or partitioned process). A finishing worker leaves etcd a moment before its
        call returns, so a vanished key becomes a fault only after ``FINISH_GRACE_S``."""
        current = {slot.worker_id: slot for rank, slot in slots.items() if rank not in done}
        if not trusted:           # etcd down or just back: no vanished key counts yet
            self._vanished.clear()
        for worker_id, record in list(self._seen.items()) if trusted else []:
            if worker_id in members or worker_id not in current \
                    or current[worker_id].node in self._away:   # went with its keeper's
                self._vanished.pop(worker_id, None)
                continue
            if record.extra.get("state") == "finished":
                continue
            since = self._vanished.setdefault(worker_id, now)
            if now - since >= FINISH_GRACE_S and worker_id not in finished():
                result.signals.append(LeaseLost(WorkerId(worker_id), since))
                del self._seen[worker_id]
                self._vanished.pop(worker_id, None)
        self._seen.update({w: r for w, r in members.items() if w in current})

    def _silent_nodes(self, slots: Mapping[int, RankSlot], done: set[int],
                      members: Mapping[str, MemberRecord], now: float, result: PollResult,
                      trusted: bool) -> None:
        """A node whose keeper's record vanished (the node's one etcd lease lapsed) while
        ranks still run there, and whose keeper and raylet both fail to answer, is lost: a
        dead host or a cut link closes no socket, so the node watch never hears of it, and
        Ray's health checks take tens of seconds. Checked once per vanishing, before the
        ranks' own vanished records count (a node's loss absorbs its ranks')."""
        present = {index for record in members.values()
                   if record.extra.get("role") == "keeper"
                   and (index := _node_of(record.node)) is not None}
        if not trusted:          # etcd down or just back: no vanished key counts yet
            self._keepers_seen |= present
            return
        running = {slot.node for rank, slot in slots.items() if rank not in done}
        for index in [i for i in self._away if i in present or i in self._dead_nodes
                      or i not in running]:
            del self._away[index]
            if index in present:
                log.info("event=keeper_back node=%s: its keeper reports again",
                         node_name(index))
        due = {index for index, probed in self._away.items() if now - probed >= AWAY_PROBE_S}
        for index in sorted((self._keepers_seen - present) | due):
            if index in self._dead_nodes or index not in running or self._watch is None:
                continue
            if self._watch.silent(index):
                log.warning("event=node_silent node=%s: its etcd lease lapsed and neither "
                            "its keeper nor its raylet answers", node_name(index))
                self._away.pop(index, None)
                self._dead_nodes.add(index)
                result.signals.append(NodeLost(node_name(index), now))
                continue
            if index not in self._away:
                log.warning("event=keeper_away node=%s: its etcd lease lapsed but the node "
                            "answers (a slow or lossy link to etcd): its ranks' records are "
                            "excused until its keeper reports again", node_name(index))
            self._away[index] = now
        self._keepers_seen = present

    def _away_progress(self, slots: Mapping[int, RankSlot], done: set[int],
                       members: Mapping[str, MemberRecord], now: float,
                       result: PollResult) -> None:
        """A rank whose record went with its keeper's lapsed lease (``_away``) is excused
        from the stall detector (its last record, out of step) until its keeper reports
        again: no record is no rank standing still."""
        for rank, slot in slots.items():
            record = self._seen.get(slot.worker_id)
            if slot.node in self._away and rank not in done and record is not None \
                    and slot.worker_id not in members:
                result.progress.append(Progress(Rank(rank), Step(record.step), now,
                                                in_step=False))

    def _node_signals(self, now: float, result: PollResult) -> None:
        if self._watch is not None:     # a node whose keeper and raylet both refuse
            for index, ended in self._watch.drain():
                if index not in self._dead_nodes:
                    self._dead_nodes.add(index)
                    result.signals.append(NodeLost(node_name(index), ended))
        if now - self._last_node_check < self._node_check_s:
            return
        self._last_node_check = now
        alive = set()
        for node in ray.nodes():
            if node.get("Alive"):
                alive.update(node_indices(node, self._nodes))
        for index in range(self._nodes):
            if index not in alive and index not in self._dead_nodes:
                self._dead_nodes.add(index)
                result.signals.append(NodeLost(node_name(index), now))

    @property
    def watch(self) -> NodeWatch | None:
        """The keeper connection watch, if the launcher holds one."""
        return self._watch

    @property
    def last_seen(self) -> Mapping[str, MemberRecord]:
        """Each current worker's last member record seen (it outlives the record in etcd);
        a read-only view, not a copy: the launcher passes it on at every poll."""
        return MappingProxyType(self._seen)

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)


def _node_of(name: str) -> int | None:
    try:
        return node_index(name)
    except ValueError:
        return None


def _worker_error(exc: RayTaskError, rank: int) -> WorkerFailed:
    cause = exc.cause if isinstance(exc.cause, BaseException) else None
    if isinstance(cause, WorkerFailed):
        return cause
    return WorkerFailed(rank, str(exc).splitlines()[0], str(exc))
