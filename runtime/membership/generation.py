"""Generations as workers see them: the fenced ``generation`` key, the worker-facing plan
published under ``plan/<generation>`` (rank -> worker, restore step, restore sources), and
a watcher that tells a worker at once when a new generation begins."""
from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

from phalanx.configs.errors import FatalError, MembershipUnavailable, TransientError
from phalanx.runtime.base import (Membership, RestoreSource, WatchEvent, source_from_json,
                                  source_to_json)

log = logging.getLogger(__name__)
GENERATION_KEY = "generation"
PLAN_PREFIX = "plan/"
# plan/<g> holds the plan's JSON zlib-compressed behind this tag. Measured on the 10,000-rank
# plan of bench/scale_sim.py: 2.83 MB of JSON (every rank's worker and restore ladder with
# addresses) is 233 KB compressed (15 ms to compress, 3.4 ms to decompress), so the fence
# stays under etcd's 1.5 MiB request limit (raw JSON failed above ~7,400 ranks) and every
# rank reading the plan after a fence reads 12x fewer bytes.
PLAN_CODEC = b"zlib1:"


class Fenced(FatalError):
    """This worker is not part of the new generation (its rank went to another worker)."""


class PlanTimeout(TransientError):
    """No plan for a newer generation arrived in time."""


@dataclass(frozen=True)
class RankAssignment:
    """Who runs a rank in a generation and where its state at ``restore_step`` comes from:
    the planner's sources in ladder order, with their addresses."""

    worker: str
    sources: tuple[RestoreSource, ...] = ()


@dataclass(frozen=True)
class GenerationPlan:
    generation: int
    world_size: int
    restore_step: int
    ranks: Mapping[int, RankAssignment] = field(default_factory=dict)
    reason: str = ""
    # the TCPStore this generation's group forms on: (host, port) of the coordinator that
    # published the plan (a standby that took over hosts a new one); None: unchanged
    store: tuple[str, int] | None = None
    # heal from live peers (runtime/worker/heal.py): survivors keep their state and the
    # ranks agree on the step after the group formed; restore_step is the fallback
    heal: bool = False

    def to_json(self) -> bytes:
        return json.dumps({
            "generation": self.generation, "world_size": self.world_size,
            "restore_step": self.restore_step, "reason": self.reason,
            "store": list(self.store) if self.store else None, "heal": self.heal,
            "ranks": {str(r): {"worker": a.worker,
                               "sources": [source_to_json(s) for s in a.sources]}
                      for r, a in sorted(self.ranks.items())},
        }, sort_keys=True, separators=(",", ":")).encode()

    def encode(self) -> bytes:
        """What ``plan/<g>`` holds: ``PLAN_CODEC`` and the compressed JSON."""
        return PLAN_CODEC + zlib.compress(self.to_json(), 6)

    @classmethod
    def decode(cls, data: bytes) -> "GenerationPlan":
        """The plan ``encode`` wrote; raises ``ValueError`` for anything else."""
        if not data.startswith(PLAN_CODEC):
            raise ValueError(f"a plan value starts with {PLAN_CODEC!r}, this one with "
                             f"{bytes(data[:8])!r}")
        try:
            return cls.from_json(zlib.decompress(data[len(PLAN_CODEC):]))
        except zlib.error as exc:
            raise ValueError(f"a plan value does not decompress: {exc}") from None

    @classmethod
    def from_json(cls, data: bytes) -> "GenerationPlan":
        raw = json.loads(data)
        ranks = {int(r): RankAssignment(str(a["worker"]),
                                        tuple(source_from_json(s) for s in a["sources"]))
                 for r, a in raw["ranks"].items()}
        store = raw.get("store")
        return cls(int(raw["generation"]), int(raw["world_size"]), int(raw["restore_step"]),
                   ranks, str(raw.get("reason", "")),
                   (str(store[0]), int(store[1])) if store else None,
                   bool(raw.get("heal", False)))


def plan_key(generation: int) -> str:
    return f"{PLAN_PREFIX}{generation:08d}"


class GenerationWatcher:
    """Watches ``generation`` from a watcher thread; ``newer_than(g)`` is a cheap local check
    the training thread makes while it waits on a collective."""

    def __init__(self, membership: Membership) -> None:
        self._membership = membership
        self._latest = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._cancel: Callable[[], None] | None = None
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the watch thread) each time a newer generation is seen."""
        self._listeners.append(listener)

    def start(self) -> "GenerationWatcher":
        self._cancel = self._membership.watch_prefix(GENERATION_KEY, self._on_event)
        current = self._membership.get(GENERATION_KEY)
        if current is not None:
            self._set(int(current.value))
        return self

    def close(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None

    @property
    def latest(self) -> int:
        return self._latest

    def newer_than(self, generation: int) -> bool:
        return self._latest > generation

    def _on_event(self, event: WatchEvent) -> None:
        if event.kind == "put" and event.key == GENERATION_KEY:
            self._set(int(event.value))

    def _set(self, value: int) -> None:
        with self._changed:
            if value <= self._latest:
                return
            self._latest = value
            self._changed.notify_all()
        for listener in list(self._listeners):
            listener()

    def wait_plan(self, after: int, timeout_s: float, poll_s: float = 0.02) -> GenerationPlan:
        """The plan of the newest generation above ``after``; raises ``PlanTimeout``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._latest > after,
                                       timeout=max(0.0, min(poll_s * 10, deadline - time.monotonic())))
                target = self._latest
            if target > after:
                try:
                    found = self._membership.get(plan_key(target))
                except MembershipUnavailable as exc:
                    log.warning("event=plan_read_failed generation=%d error=%s", target, exc)
                    found = None
                if found is not None:
                    return GenerationPlan.decode(found.value)
            if time.monotonic() > deadline:
                raise PlanTimeout(f"no plan for a generation after {after} within {timeout_s} s")
            time.sleep(poll_s)
