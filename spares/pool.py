"""The warm spare pool: ``spares.count`` worker actors spread over the nodes, each already
past the expensive start-up (torch and the entrypoint imported, the warm-up hook run), so a
lost rank is taken over in milliseconds instead of seconds. Refilled after each promotion."""
from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ray

from phalanx.runtime.logs import current_format
from phalanx.spares.actor import WorkerActor

log = logging.getLogger(__name__)
HEALTH_EVERY_S = 1.0      # how often an idle spare is pinged
PROMOTE_PING_S = 0.3      # the ping of every warm spare when a recovery plans


@dataclass
class Spare:
    spare_id: str
    node: int
    actor: Any
    ready: Any  # ObjectRef of the warm-up ping
    name: str = ""   # the actor's name in the job's Ray namespace


class SparePool:
    """Owned by the launcher's main thread. ``take`` hands out a warm spare; ``refill``
    starts replacements on the nodes that are still alive."""

    def __init__(self, count: int, entrypoint: str, torch_threads: int, warmup: str,
                 cpus: float, node_resource: Callable[[int], str], job: str,
                 detached: bool = False, resources: dict[str, float] | None = None,
                 nodes: list[int] | None = None, replenish: bool = True,
                 rank_nodes: Callable[[], Iterable[int]] = tuple) -> None:
        """``resources``: what each spare asks Ray for besides its node (CPU and GPU become
        num_cpus / num_gpus; ``cpus`` is the CPU default); ``nodes``: the only nodes spares
        may use (None: every node); ``replenish``: refill after promotions; ``rank_nodes``:
        the node of every rank now (spares go to the nodes running the fewest processes)."""
        self._count = count
        self._entrypoint = entrypoint
        self._threads = torch_threads
        self._warmup = warmup
        self._node_resource = node_resource
        self._job = job
        self._spares: dict[str, Spare] = {}
        self._serial = 0
        self._lifetime = {"lifetime": "detached"} if detached else {}
        extra = dict(resources or {})
        self._cpus = extra.pop("CPU", cpus)
        self._gpus = extra.pop("GPU", 0)
        self._custom = extra
        self._allowed = set(nodes) if nodes else None
        self._replenish = replenish
        self._rank_nodes = rank_nodes
        self._health: dict[str, Any] = {}          # spare id -> pending health ping
        self._next_health: dict[str, float] = {}

    def start(self, nodes: list[int]) -> "SparePool":
        usable = self._usable(nodes)
        for _ in range(self._count if usable else 0):
            self._add(self._least_used(usable))
        return self

    def _least_used(self, nodes: list[int]) -> int:
        return least_used(nodes, [*self._rank_nodes(), *(s.node for s in self._spares.values())])

    def _usable(self, nodes: list[int]) -> list[int]:
        return [n for n in nodes if self._allowed is None or n in self._allowed]

    def _add(self, node: int) -> Spare:
        spare_id = f"spare{self._serial}"
        self._serial += 1
        name = f"{self._job}-{spare_id}"
        actor = WorkerActor.options(  # type: ignore[attr-defined]  # @ray.remote adds options
            num_cpus=self._cpus, num_gpus=self._gpus,
            resources={self._node_resource(node): 1, **self._custom}, name=name,
            **self._lifetime).remote(self._entrypoint, self._threads, self._warmup,
                                     current_format())   # the launcher's --log-format
        spare = Spare(spare_id, node, actor, actor.ping.remote(), name)
        self._spares[spare_id] = spare
        log.info("event=spare_started spare=%s node=%d", spare_id, node)
        return spare

    def adopt(self, spares: dict[str, dict[str, Any]], serial: int) -> "SparePool":
        """Take over the spares another launcher started (``describe()``'s output): found
        by name; one that is gone is dropped and replaced by ``refill``."""
        self._serial = serial
        for spare_id, info in spares.items():
            try:
                actor = ray.get_actor(info["actor"])
            except ValueError:
                log.warning("event=spare_gone spare=%s", spare_id)
                continue
            self._spares[spare_id] = Spare(spare_id, int(info["node"]), actor,
                                           actor.ping.remote(), info["actor"])
        return self

    def describe(self) -> tuple[dict[str, dict[str, Any]], int]:
        """spare id → {node, actor name}, and the next serial: what a successor adopts."""
        return ({s.spare_id: {"node": s.node, "actor": s.name} for s in self._spares.values()},
                self._serial)

    def inventory(self, live_nodes: set[int]) -> dict[str, int]:
        """spare id → node of every spare that is warm and on a live node."""
        ready = {s.spare_id: s.node for s in self._spares.values() if s.node in live_nodes}
        refs = {self._spares[i].ready: i for i in ready}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        warm = {refs[ref] for ref in done}
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # a spare that died while idle is dropped from the pool
                warm.discard(refs[ref])
                self._spares.pop(refs[ref], None)
        for spare_id in self._dead(warm):
            warm.discard(spare_id)
            self._spares.pop(spare_id, None)
        return {spare_id: node for spare_id, node in ready.items() if spare_id in warm}

    def warming(self, live_nodes: set[int], warm: set[str]) -> dict[str, int]:
        """spare id -> node of every spare on a live node still warming up (``warm``: the
        ids ``inventory`` found warm). Promoted, it runs the rank once its warm-up ends."""
        return {s.spare_id: s.node for s in self._spares.values()
                if s.node in live_nodes and s.spare_id not in warm}

    def _dead(self, spare_ids: set[str]) -> list[str]:
        """Of these warm spares, those whose process is gone: one ping each, all at once,
        at most ``PROMOTE_PING_S`` (a live idle spare answers in milliseconds). The
        periodic health check may not have pinged a spare killed just before a recovery;
        promoting it would cost a second recovery. A spare that does not answer in time
        is kept (busy, not dead)."""
        pings = {self._spares[i].actor.ping.remote(): i for i in spare_ids}
        if not pings:
            return []
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PROMOTE_PING_S)
        dead = []
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # the spare's process is gone
                log.warning("event=spare_lost spare=%s error=%r", pings[ref], str(exc)[:200])
                dead.append(pings[ref])
        return dead

    def readiness(self) -> tuple[int, int]:
        """(warm, starting): spares whose warm-up has returned and those still warming up.
        Non-blocking and without side effects (the metrics ask at every refresh); a spare
        whose warm-up failed counts as warm until ``inventory`` or ``check`` drops it."""
        refs = [spare.ready for spare in self._spares.values()]
        if not refs:
            return 0, 0
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done), len(refs) - len(done)

    def check(self, live_nodes: set[int], now: float | None = None) -> list[str]:
        """Find warm spares that died while idle (a health ping every ``HEALTH_EVERY_S``
        fails) and replace them; returns the lost spare ids. Non-blocking."""
        now = time.monotonic() if now is None else now
        lost = []
        for spare_id, spare in list(self._spares.items()):
            probe = self._health.get(spare_id)
            if probe is None:
                if now >= self._next_health.get(spare_id, 0.0):
                    self._health[spare_id] = spare.actor.ping.remote()
                continue
            done, _ = ray.wait([probe], timeout=0)
            if not done:
                continue
            del self._health[spare_id]
            self._next_health[spare_id] = now + HEALTH_EVERY_S
            try:
                ray.get(probe, timeout=0)
            except Exception as exc:  # the spare's process is gone: drop and replace it
                log.warning("event=spare_lost spare=%s error=%r", spare_id, str(exc)[:200])
                self._spares.pop(spare_id, None)
                lost.append(spare_id)
        if lost:
            self.refill(sorted(live_nodes))
        return lost

    def actors(self) -> dict[str, Any]:
        """spare id -> actor handle of every spare in the pool (warm or warming)."""
        return {spare_id: spare.actor for spare_id, spare in self._spares.items()}

    def take(self, spare_id: str) -> Spare:
        self._health.pop(spare_id, None)
        return self._spares.pop(spare_id)

    def refill(self, live_nodes: list[int], at_least: int = 0) -> None:
        """Start spares until the pool holds ``spares.count`` again (or ``at_least``, when
        a parked recovery needs more: Ray starts them as the cluster has room), on the
        least-used live nodes."""
        live_nodes = self._usable(live_nodes)
        if not live_nodes or (not self._replenish and at_least == 0):
            return
        while len(self._spares) < max(self._count if self._replenish else 0, at_least):
            self._add(self._least_used(live_nodes))

    def discard(self, name: str) -> None:
        """Drop the spare whose actor is ``name`` (a standby found it already promoted)."""
        for spare_id in [i for i, s in self._spares.items() if s.name == name]:
            self._spares.pop(spare_id)

    def forget_node(self, node: int) -> None:
        for spare_id in [i for i, s in self._spares.items() if s.node == node]:
            self._spares.pop(spare_id)

    def close(self) -> None:
        for spare in self._spares.values():
            with contextlib.suppress(Exception):  # teardown: the actor may already be gone
                ray.kill(spare.actor, no_restart=True)
        self._spares.clear()


def least_used(nodes: list[int], occupied: Iterable[int]) -> int:
    """The node of ``nodes`` that runs the fewest ranks and spares (``occupied``: the node
    of each), the lowest index among equals. Round robin puts the ranks that do not divide
    evenly on the first nodes: 4 ranks on 3 nodes run 2 on node 0, so a spare there made
    three processes on it while nodes 1 and 2 ran one each."""
    used = Counter(occupied)
    return min(nodes, key=lambda node: (used[node], node))
