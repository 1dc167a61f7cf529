"""Fires drill faults into the live job from the launcher's main thread: a scenario's faults
when their trigger is due, and faults ``phalanx drill inject`` wrote to etcd; runs the
actions mechanisms defer (a SIGCONT, a link healed) when they are due."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Mapping

from phalanx.configs.errors import ConfigError, MembershipUnavailable, TierUnavailable
from phalanx.launcher.drills.scenario import Scenario, parse_fault, probability_step
from phalanx.launcher.drills.catalogue import FaultEnv, FaultSpec, TierPrecondition, catalogue
from phalanx.runtime.base import MemberRecord, Membership
from phalanx.runtime.tiers.config import open_tier
from phalanx.runtime.tiers.run_identity import run_id_of
from phalanx.runtime.worker.drill_hooks import gate_key, gate_reason

log = logging.getLogger(__name__)
INJECT_PREFIX = "drills/inject/"
INJECT_POLL_S = 0.25      # how often etcd is asked for injected faults
GATE_QUORUM_S = 3.0       # longest a gated fault waits for the last rank to come to its gate
TIER_POLL_S = 0.5         # how often a fault waiting for a tier commit lists that tier
TierSteps = Callable[[str], list[int]]   # tier name -> this run's committed steps there


class Deferred:
    """Actions due later, run on the launcher's main thread by ``run_due``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: list[tuple[float, Callable[[], None]]] = []

    def add(self, seconds: float, action: Callable[[], None]) -> None:
        self._due.append((self._clock() + seconds, action))

    def run_due(self, everything: bool = False) -> None:
        now = self._clock()
        ready = [item for item in self._due if everything or item[0] <= now]
        self._due = [item for item in self._due if not (everything or item[0] <= now)]
        for _, action in sorted(ready, key=lambda item: item[0]):
            try:
                action()
            except Exception as exc:  # one failed undo must not stop the others or the job
                log.warning("event=drill_deferred_failed error=%r", exc)


class Injector:
    """Owned by the launcher's main thread; ``poll`` once per monitor poll.

    A scenario's fault due at step N fires when every rank is held at N's gate (before
    running step N, its snapshots published: ``phalanx.runtime.worker.drill_hooks``), then
    the gate is released; so it hits exactly step N. A rank that never comes to the gate
    (dead, hung, a script without ``session.step()``) delays it at most ``GATE_QUORUM_S``
    after the first rank arrived, or until some rank is past N. A fault with
    ``after_tier_commit`` then also waits (its ranks still held) until the tier lists that
    step committed for this run, at most its ``within_s``; its ``drill_fault`` event
    carries ``precondition`` (met, waited_s), and an unmet one is an event of its own."""

    def __init__(self, scenario: Scenario | None, env: FaultEnv, membership: Membership,
                 deferred: Deferred, clock: Callable[[], float] = time.monotonic,
                 tier_steps: TierSteps | None = None) -> None:
        self._pending = list(scenario.faults) if scenario else []
        self._when = {spec.index: _due_step(spec) for spec in self._pending}
        self._gates = set(gate_steps(scenario))
        self._released: set[int] = set()
        self._held_since: dict[int, float] = {}
        self._env = env
        self._membership = membership
        self._deferred = deferred
        self._clock = clock
        self._first_step_at: float | None = None
        self._injected = 0
        self._next_inject_poll = 0.0
        self._tier_steps = tier_steps or self._run_tier_steps
        self._tiers: dict[str, Any] = {}
        self._waiting_since: dict[int, float] = {}
        self._next_tier_check: dict[int, float] = {}
        self._preconditions: dict[int, dict[str, Any]] = {}
        self.fired: list[dict[str, Any]] = []

    @property
    def waiting(self) -> bool:
        """Whether a scenario fault is still to fire (the watch loop then reads the member
        table at every poll, so a step-triggered fault fires at the step it names)."""
        return bool(self._pending)

    def poll(self, members: Mapping[str, MemberRecord]) -> None:
        self._deferred.run_due()
        furthest = max((m.step for m in members.values() if m.rank >= 0), default=-1)
        now = self._clock()
        if self._first_step_at is None and furthest >= 1:
            self._first_step_at = now
        for spec in [s for s in self._pending
                     if self._due(s, members, furthest, now) and self._ready(s, now)]:
            self._pending.remove(spec)
            if catalogue()[spec.kind].ends_launcher:   # no release after it: release first
                self._release_gates(ended=True)
            self.fire(spec, furthest)
        self._release_gates()
        if now >= self._next_inject_poll:
            self._next_inject_poll = now + INJECT_POLL_S
            self._poll_injected(furthest)

    def _due(self, spec: FaultSpec, members: Mapping[str, MemberRecord], furthest: int,
             now: float) -> bool:
        if spec.at_time_s is not None:
            return self._first_step_at is not None and now - self._first_step_at >= spec.at_time_s
        step = self._when[spec.index]
        if step is None or furthest < step:
            return False
        if step not in self._gates or furthest > step:
            return True
        reason = gate_reason(step)
        held = {m.rank for m in members.values() if m.rank >= 0 and m.step == step
                and m.extra.get("busy") == reason}
        if len(held) >= self._env.config().job.world_size:
            return True
        return now - self._held_since.setdefault(step, now) >= GATE_QUORUM_S

    def _ready(self, spec: FaultSpec, now: float) -> bool:
        """A due fault's ``after_tier_commit``: met (the tier lists the step, asked every
        TIER_POLL_S), or waited ``within_s`` (it fires anyway, the unmet wait an event)."""
        pre = spec.after_tier_commit
        if pre is None or spec.index in self._preconditions:
            return True
        waited = now - self._waiting_since.setdefault(spec.index, now)
        if now >= self._next_tier_check.get(spec.index, now):
            self._next_tier_check[spec.index] = now + TIER_POLL_S
            if pre.step in self._listed(pre):
                self._preconditions[spec.index] = _precondition(pre, True, waited)
                return True
        if waited < pre.within_s:
            return False
        self._preconditions[spec.index] = _precondition(pre, False, waited)
        self._env.emit("drill_precondition_unmet", index=spec.index, kind=spec.kind,
                       **self._preconditions[spec.index])
        log.warning("event=drill_precondition_unmet kind=%s tier=%s step=%d waited_s=%.1f",
                    spec.kind, pre.tier, pre.step, waited)
        return True

    def _listed(self, pre: TierPrecondition) -> list[int]:
        try:
            return self._tier_steps(pre.tier)
        except (ConfigError, TierUnavailable, OSError) as exc:   # unmet: asked again
            log.info("event=drill_tier_list_failed tier=%s error=%s", pre.tier, exc)
            return []

    def _run_tier_steps(self, name: str) -> list[int]:
        """This run's committed steps in tier ``name``, as its keepers' tiers see them."""
        tier = self._tiers.get(name)
        if tier is None:
            cfg = self._env.config()
            if not getattr(cfg.tiers, name).enabled:
                raise ConfigError(f"tiers.{name}.enabled", "is false: the drill waits for a "
                                  "step that tier never gets", f"enable tiers.{name}")
            run_dir = self._env.run_dir
            tier = self._tiers[name] = open_tier(cfg, name, run_dir=run_dir,
                                                 run_id=run_id_of(run_dir))
        return list(tier.committed_steps())

    def _release_gates(self, ended: bool = False) -> None:
        """Put the key of every gate whose faults all fired (``ended``: every gate, the
        launcher is about to end); a put etcd refused is tried again next poll."""
        waiting = {self._when[s.index] for s in self._pending}
        for step in sorted(self._gates - self._released):
            if step in waiting and not ended:
                continue
            try:
                self._membership.put(gate_key(step), b"fired")
            except MembershipUnavailable as exc:
                log.info("event=drill_gate_release_failed step=%d error=%s", step, exc)
                return
            self._released.add(step)

    def fire(self, spec: FaultSpec, step: int, origin: str = "scenario") -> dict[str, Any]:
        """Inject ``spec`` now; the ``drill_fault`` event records what its mechanism did."""
        mechanism = catalogue()[spec.kind]
        record: dict[str, Any] = {"index": spec.index, "kind": spec.kind,
                                  "family": mechanism.family, "target": spec.target_text(),
                                  "trigger": spec.trigger_text(), "step": step,
                                  "origin": origin, "params": dict(spec.params)}
        if spec.index in self._preconditions:
            record["precondition"] = dict(self._preconditions[spec.index])
        if mechanism.ends_launcher:      # its event first: this process ends in fire()
            self._env.emit("drill_fault", **record, details={"pid": os.getpid()})
        try:
            record["details"] = dict(mechanism.fire(spec, self._env))
        except Exception as exc:  # a fault that could not be injected is reported, not hidden
            record["details"] = {"error": f"{type(exc).__name__}: {exc}"}
            log.warning("event=drill_fault_failed kind=%s error=%r", spec.kind, exc)
        self.fired.append(record)
        self._env.emit("drill_fault", **record)
        return record

    def _poll_injected(self, furthest: int) -> None:
        """Faults another process put under ``drills/inject/`` (``phalanx drill inject``);
        etcd unreachable (an etcd_restart drill): asked again at the next poll."""
        try:
            injected = self._membership.list_prefix(INJECT_PREFIX)
        except MembershipUnavailable as exc:
            log.info("event=drill_inject_poll_failed error=%s", exc)
            return
        for kv in injected:
            self._membership.delete(kv.key)
            self._injected += 1
            index = 1000 + self._injected
            try:
                spec = parse_fault(json.loads(kv.value), f"inject {kv.key}", "drill inject", index)
            except (ConfigError, ValueError) as exc:
                self._env.emit("drill_inject_refused", key=kv.key, error=str(exc))
                continue
            if spec.at_step is not None and furthest < spec.at_step:
                self._pending.append(spec)     # "at step N" still ahead: wait for it
                self._when[spec.index] = spec.at_step
            else:
                self.fire(spec, furthest, origin="inject")

    def close(self) -> None:
        """Undo what is still deferred (resume stopped processes, heal links)."""
        self._deferred.run_due(everything=True)


def gate_steps(scenario: Scenario | None) -> tuple[int, ...]:
    """The steps ``scenario``'s step-triggered faults are due at, in order."""
    if scenario is None:
        return ()
    return tuple(sorted({s for s in map(_due_step, scenario.faults) if s is not None}))


def _precondition(pre: TierPrecondition, met: bool, waited_s: float) -> dict[str, Any]:
    return {"tier": pre.tier, "step": pre.step, "met": met, "waited_s": round(waited_s, 3),
            "within_s": pre.within_s}


def _due_step(spec: FaultSpec) -> int | None:
    if spec.at_step is not None:
        return spec.at_step
    if spec.probability is not None:
        return probability_step(spec)
    return None
