"""Replaces a node keeper that died while its node lives (SIGKILL, a crash): a new keeper
actor on the same node, replica placement sent to every keeper again, and the node's
workers find it through ``keepers/<node>`` (``phalanx.runtime.worker.keeper_link``). The dead keeper's
snapshots are gone (its shared memory is unlinked); its ranks' replicas on other nodes
remain, and training never stops: no generation change, no rollback."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ray
from ray.exceptions import RayActorError

from phalanx.configs.loader import dump_config
from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.coordination.coordinator import RankSlot, RecoveryCoordinator
from phalanx.launcher.keeper_actor import KeeperActor
from phalanx.runtime.base import node_name
from phalanx.launcher.coordination.node_watch import NodeWatch, refuses
from phalanx.launcher.services.ray_cluster import node_resource, raylet_addresses
from phalanx.launcher.coordination.takeover import keeper_actor_name
from phalanx.runtime.keeper.shm import remove_stale, shm_prefix
from phalanx.runtime.logs import current_format

log = logging.getLogger(__name__)
PROBE_EVERY_S = 0.5        # how often each keeper actor is asked whether it lives ...
WATCHED_PROBE_EVERY_S = 5.0   # ... a safety net only when the node watch sees keepers die
START_TIMEOUT_S = 60.0     # a new keeper that has not answered by then failed to start
MAX_ATTEMPTS = 3           # starts tried per lost keeper before the job is told it failed


def start_keeper_actor(cfg: PhalanxConfig, node: int, secret_hex: str,
                       etcd_endpoints: list[str], run_dir: str, local_ranks: list[int]) -> Any:
    """A keeper actor pinned to ``node`` under the job's keeper name (as at launch), logging
    in this launcher's format."""
    lifetime = {"lifetime": "detached"} if cfg.coordinator.standby else {}
    return KeeperActor.options(  # type: ignore[attr-defined]  # @ray.remote adds options
        resources={node_resource(node): 1},
        name=keeper_actor_name(cfg.job.name, node), **lifetime).remote(
        node_name(node), dump_config(cfg), secret_hex, etcd_endpoints, run_dir, local_ranks,
        current_format())


@dataclass
class _Starting:
    """A replacement keeper being started: its actor and the ref of its ``address()``."""

    actor: Any
    address_ref: Any
    lost_at: float          # coordinator clock: when the old keeper was noticed gone
    lost_wall: float
    cause: str
    attempt: int
    started_at: float


class KeeperRestarts:
    """Owned by the launcher's main thread; ``poll()`` once per watch-loop turn, never
    blocking: liveness probes and a new keeper's start are collected with
    ``ray.wait(timeout=0)``. A keeper is lost when the node watch finds its port refusing on
    a live node, or when Ray says its actor died; a node that is itself gone is left to node
    recovery. ``on_started(actor)`` registers a new keeper for teardown."""

    def __init__(self, cfg: PhalanxConfig, keepers: dict[int, tuple[Any, tuple[str, int]]],
                 coordinator: RecoveryCoordinator, slots: Mapping[int, RankSlot],
                 watch: NodeWatch | None, secret_hex: str, etcd_endpoints: list[str],
                 on_started: Callable[[Any], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cfg = cfg
        self._keepers = keepers
        self._coordinator = coordinator
        self._slots = slots
        self._watch = watch
        self._secret_hex, self._etcd_endpoints = secret_hex, etcd_endpoints
        self._on_started = on_started
        self._clock = clock
        self._probes: dict[int, Any] = {}          # node -> ref of a pid() call in flight
        self._next_probe = 0.0
        self._probe_every = PROBE_EVERY_S if watch is None else WATCHED_PROBE_EVERY_S
        self._starting: dict[int, _Starting] = {}
        self._retry: dict[int, tuple[float, float, str, int]] = {}   # node -> lost, wall, ...
        self._announced: set[int] = set()          # nodes whose keeper_lost was emitted
        self.restarts = 0

    def poll(self) -> None:
        if not self._keepers or not self._cfg.snapshot.enabled:
            return
        now = self._clock()
        lost = dict(self._retry)
        self._retry.clear()
        if self._watch is not None:
            for node, _ in self._watch.keepers_gone():
                lost.setdefault(node, (now, time.time(), "keeper port refused, raylet alive", 1))
        for node in self._dead_actors(now):
            lost.setdefault(node, (now, time.time(), "Ray reports the keeper actor died", 1))
        for node, (at, wall, cause, attempt) in sorted(lost.items()):
            if node not in self._starting:
                self._begin(node, at, wall, cause, attempt)
        self._collect(now)

    # -- noticing ------------------------------------------------------------------------
    def _dead_actors(self, now: float) -> list[int]:
        """Nodes whose keeper actor Ray reports dead (probes answered since the last poll);
        asks every live keeper again every ``PROBE_EVERY_S`` (``WATCHED_PROBE_EVERY_S`` when
        the node watch reports dead keepers within milliseconds)."""
        dead = []
        if self._probes:
            refs = {ref: node for node, ref in self._probes.items()}
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in ready:
                node = refs[ref]
                del self._probes[node]
                try:
                    ray.get(ref, timeout=0)
                except RayActorError:
                    dead.append(node)
                except Exception as exc:  # a probe that failed otherwise proves nothing
                    log.info("event=keeper_probe_failed node=%s error=%r", node_name(node), exc)
        if now >= self._next_probe:
            self._next_probe = now + self._probe_every
            for node in self._live():
                if node not in self._probes and node not in self._starting:
                    self._probes[node] = self._keepers[node][0].pid.remote()
        return [n for n in dead if n in self._live()]

    def _live(self) -> list[int]:
        return sorted(n for n in self._coordinator.live_nodes if n in self._keepers)

    def _node_alive(self, node: int) -> bool:
        """Whether ``node`` itself lives: its raylet is in Ray's table and accepts."""
        raylet = raylet_addresses(self._cfg.job.nodes).get(node)
        return raylet is not None and not refuses(raylet)

    # -- replacing -----------------------------------------------------------------------
    def _begin(self, node: int, lost_at: float, lost_wall: float, cause: str,
               attempt: int) -> None:
        """Unlink the dead keeper's memory and start its replacement (not awaited)."""
        if node not in self._live() or not self._node_alive(node):
            log.info("event=keeper_restart_skipped node=%s reason=node_not_live", node_name(node))
            return
        self._probes.pop(node, None)
        if attempt == 1 and node not in self._announced:
            self._announced.add(node)
            removed = remove_stale(self._cfg.snapshot.shm_dir,
                                   shm_prefix(self._cfg.job.name, node_name(node)))
            self._coordinator.events.emit("keeper_lost", node=node_name(node), cause=cause,
                                          shm_files_removed=len(removed))
        with contextlib.suppress(Exception):   # Ray keeps a dead actor's name until killed
            ray.kill(self._keepers[node][0], no_restart=True)
        ranks = sorted(r for r, s in self._slots.items() if s.node == node)
        try:
            actor = start_keeper_actor(self._cfg, node, self._secret_hex, self._etcd_endpoints,
                                       self._coordinator.run_dir, ranks)
        except ValueError as exc:  # the dead actor's name is not released yet: next poll
            log.warning("event=keeper_restart_deferred node=%s error=%s", node_name(node), exc)
            self._retry[node] = (lost_at, lost_wall, cause, attempt)
            return
        self._on_started(actor)
        self._starting[node] = _Starting(actor, actor.address.remote(), lost_at, lost_wall,
                                         cause, attempt, self._clock())

    def _collect(self, now: float) -> None:
        """Install each replacement whose ``address()`` answered; retry or give up on the
        ones that died or did not answer in ``START_TIMEOUT_S``."""
        if not self._starting:
            return
        refs = {s.address_ref: node for node, s in self._starting.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            node = refs[ref]
            starting = self._starting.pop(node)
            try:
                address = ray.get(ref, timeout=0)
            except Exception as exc:  # it died while starting: try again, or report
                self._failed(node, starting, f"{type(exc).__name__}: {exc}")
                continue
            self._install(node, starting, (str(address[0]), int(address[1])))
        for node, starting in list(self._starting.items()):
            if node not in self._coordinator.live_nodes or now - starting.started_at > \
                    START_TIMEOUT_S:
                del self._starting[node]
                with contextlib.suppress(Exception):   # it may never have started
                    ray.kill(starting.actor, no_restart=True)
                self._failed(node, starting, "not started within "
                             f"{START_TIMEOUT_S:.0f} s or its node left")

    def _failed(self, node: int, starting: _Starting, error: str) -> None:
        self._coordinator.events.emit("keeper_restart_failed", node=node_name(node),
                                      attempt=starting.attempt, error=error[:300])
        if starting.attempt < MAX_ATTEMPTS and node in self._coordinator.live_nodes:
            self._retry[node] = (starting.lost_at, starting.lost_wall, starting.cause,
                                 starting.attempt + 1)

    def _install(self, node: int, starting: _Starting, address: tuple[str, int]) -> None:
        """The new keeper serves: the launcher uses it, the watch follows it, every keeper
        gets the placement again (replicas of and to this node resume)."""
        self._keepers[node] = (starting.actor, address)
        self._announced.discard(node)
        if self._watch is not None:
            self._watch.rewatch(node, address)
        self._coordinator.place(self._slots)
        self.restarts += 1
        seconds = self._clock() - starting.lost_at
        self._coordinator.events.emit(
            "keeper_restarted", node=node_name(node), host=address[0], port=address[1],
            attempt=starting.attempt, cause=starting.cause, seconds=round(seconds, 3),
            lost_time=starting.lost_wall)
        log.warning("event=keeper_restarted node=%s address=%s:%d seconds=%.3f",
                    node_name(node), address[0], address[1], seconds)
