"""The live job as drill mechanisms see it (``phalanx.launcher.drills.catalogue.FaultEnv``): processes by rank,
node and role, the keepers and their replication routes, the job's services, and a way to
undo a fault later; backed by the launcher's own objects."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import ray

from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.drills.injector import Deferred
from phalanx.runtime.base import node_name
from phalanx.runtime.base import MemberRecord

log = logging.getLogger(__name__)
PID_TIMEOUT_S = 5.0


class JobFaultEnv:
    """Owned by the launcher's main thread (``JobRunner._watch`` builds it)."""

    def __init__(self, cfg: PhalanxConfig, run_dir: Path, slots: dict[int, RankSlot],
                 coordinator: RecoveryCoordinator, services: Any, pool: Any,
                 remove_node: Callable[[int], None], deferred: Deferred,
                 extra_services: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.shm_dir = cfg.snapshot.shm_dir
        self.job = cfg.job.name
        self._slots = slots
        self._coordinator = coordinator
        self._services = services
        self._pool = pool
        self._remove_node = remove_node
        self._deferred = deferred
        self._extra = dict(extra_services or {})

    def members(self) -> Mapping[str, MemberRecord]:
        return self._services.membership.members()

    def config(self) -> PhalanxConfig:
        return self.cfg

    def rank_pid(self, rank: int) -> int | None:
        """The pid of the worker that holds ``rank`` now, from its member record (a busy
        worker actor cannot answer Ray calls until its entrypoint returns)."""
        slot = self._slots.get(rank)
        if slot is None:
            return None
        return next((r.pid for r in self.members().values()
                     if r.worker_id == slot.worker_id and r.pid), None)

    def node_pids(self, node: int) -> list[int]:
        return [m.pid for m in self.members().values() if m.node == node_name(node) and m.pid]

    def remove_node(self, node: int) -> None:
        self._remove_node(node)

    def keeper_pid(self, node: int) -> int | None:
        keeper = self._coordinator.keepers.get(node)
        if keeper is None:
            return None
        return int(ray.get(keeper[0].pid.remote(), timeout=PID_TIMEOUT_S))

    def keeper_actor(self, node: int) -> Any:
        keeper = self._coordinator.keepers.get(node)
        return keeper[0] if keeper is not None and node in self._coordinator.live_nodes \
            else None

    def keeper_address(self, node: int) -> tuple[str, int]:
        host, port = self._coordinator.keepers[node][1]
        return str(host), int(port)

    def keeper_route(self, node: int, address: tuple[str, int] | None) -> None:
        """Send node ``node``'s replicas to ``address`` (a proxy) instead of its keeper;
        None routes them straight to the keeper again. Placement is re-sent to the keepers."""
        if address is None:
            self._coordinator.routes.pop(node, None)
        else:
            self._coordinator.routes[node] = address
        self._coordinator.place(self._slots)

    def spare_pids(self) -> dict[str, int]:
        if self._pool is None:
            return {}
        return {spare_id: pid for spare_id, actor in self._pool.actors().items()
                if (pid := _actor_pid(actor)) is not None}

    def service(self, name: str) -> Any:
        if name in self._extra:
            return self._extra[name]
        if name == "etcd":
            return self._services.etcd
        if name == "ray":
            return self._services.local_ray
        raise KeyError(f"no service {name!r} in this job")

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        """Run ``action`` on the launcher's main thread after ``seconds`` (also when the job
        ends first)."""
        self._deferred.add(seconds, action)

    def emit(self, event: str, **fields: Any) -> None:
        self._coordinator.events.emit(event, **fields)


def _actor_pid(actor: Any) -> int | None:
    try:
        return int(ray.get(actor.ping.remote(), timeout=PID_TIMEOUT_S)["pid"])
    except Exception as exc:  # a dead or busy actor has no pid to offer
        log.warning("event=drill_pid_unknown error=%r", str(exc)[:200])
        return None
