"""What passes from a leader to the standby that succeeds it: the leader describes the job
(``job_state``, published when it changes by ``StatePublisher``); the standby finds the same
actors by name (``adopt_keepers``, ``adopt_workers``) and restores its coordinator's view
(``resume_coordinator``). Only names and plain values cross: Ray actor names in the job's
namespace, JSON in etcd."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Mapping

import ray

from phalanx.configs.errors import MembershipUnavailable
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.services.leadership import JobState, publish_state
from phalanx.recovery.detection import ActorDied
from phalanx.runtime.base import Membership, NodeId, Rank, WorkerId
from phalanx.runtime.membership.generation import GenerationPlan, RankAssignment, plan_key
from phalanx.runtime.replication.placement import Placement

log = logging.getLogger(__name__)


def keeper_actor_name(job: str, node: int) -> str:
    return f"{job}-keeper{node}"


def job_state(run_dir: str, job: str, slots: Mapping[int, RankSlot],
              keepers: Mapping[int, tuple[Any, tuple[str, int]]],
              coordinator: RecoveryCoordinator) -> JobState:
    """The leader's description of its job, as a standby needs it."""
    pool = coordinator.pool
    spares, serial = pool.describe() if pool is not None else ({}, 0)
    placement = coordinator.placement
    return JobState(
        run_dir=run_dir, generation=coordinator.generation,
        slots={r: {"worker_id": s.worker_id, "node": s.node, "actor": s.name}
               for r, s in slots.items()},
        keepers={n: {"actor": keeper_actor_name(job, n), "host": addr[0], "port": addr[1]}
                 for n, (_, addr) in keepers.items()},
        spares=spares, spare_serial=serial, live_nodes=sorted(coordinator.live_nodes),
        recoveries=coordinator.recoveries,
        holders={int(r): list(h) for r, h in placement.holders.items()} if placement else {},
        history=list(coordinator.history))


class StatePublisher:
    """Writes the job state to etcd when it changed since the last write."""

    def __init__(self, membership: Membership) -> None:
        self._membership = membership
        self._published = b""

    def publish(self, state: JobState) -> None:
        """Write ``state`` if it changed; etcd unreachable: tried again at the next call."""
        encoded = state.to_json()
        if encoded != self._published:
            try:
                publish_state(self._membership, state)   # type: ignore[arg-type]
            except MembershipUnavailable as exc:
                log.warning("event=state_publish_failed error=%s", exc)
                return
            self._published = encoded


def adopt_keepers(state: JobState) -> dict[int, tuple[Any, tuple[str, int]]]:
    """node → (keeper actor, address) of every keeper still alive; a missing one went with
    its node."""
    keepers = {}
    for node, info in sorted(state.keepers.items()):
        with contextlib.suppress(ValueError):
            keepers[node] = (ray.get_actor(info["actor"]), (info["host"], int(info["port"])))
    return keepers


def adopt_workers(state: JobState, generation: int, membership: Membership,
                  job: str) -> tuple[dict[int, RankSlot], list[ActorDied], list[str]]:
    """The leader's workers, each watched through ``result`` (it answers when the entrypoint
    ends, or fails when the actor dies). Returns the slots, a fault signal for each worker
    that is gone or that the newest plan moved after the state was published (the leader
    died mid-recovery), and the actor names of the replacements that plan may have started
    (to be killed: a new plan replaces them)."""
    planned: Mapping[int, RankAssignment] = {}
    if generation != state.generation:
        found = membership.get(plan_key(generation))
        planned = GenerationPlan.decode(found.value).ranks if found else {}
    slots, lost, doomed = {}, [], []
    for rank, info in sorted(state.slots.items()):
        slot = RankSlot(rank, info["worker_id"], int(info["node"]), None, name=info["actor"])
        moved = rank in planned and planned[rank].worker != slot.worker_id
        try:
            slot.actor = ray.get_actor(info["actor"])
        except ValueError:
            moved = True
        if moved:
            lost.append(ActorDied(WorkerId(slot.worker_id), time.monotonic(),
                                  "gone when the standby took over"))
            if rank in planned:
                doomed.append(f"{job}-{planned[rank].worker}")
        else:
            slot.ref = slot.actor.result.remote()
        slots[rank] = slot
    return slots, lost, doomed


def resume_coordinator(coordinator: RecoveryCoordinator, state: JobState, generation: int,
                       keeper_nodes: set[int] | None) -> None:
    """The standby's coordinator continues the leader's: generation (etcd's, which may be
    ahead of the state), live nodes (those whose keeper is alive, when there are keepers),
    recoveries so far and the replica placement."""
    coordinator.generation = generation
    coordinator.live_nodes = {n for n in state.live_nodes
                              if keeper_nodes is None or n in keeper_nodes}
    coordinator.recoveries, coordinator.history = state.recoveries, list(state.history)
    if state.holders:
        coordinator.placement = Placement({Rank(r): tuple(NodeId(n) for n in h)
                                           for r, h in state.holders.items()})
