"""The fault catalogue: what each drill fault is (family, what it targets, its parameters),
and the live job's handle a fault's mechanism acts through (``FaultEnv``). Mechanisms
live in one module per family (``faults_process``, ``faults_storage``, ``faults_network``,
``fault_memory``) and register themselves here; each is a real mechanism (a signal, bytes
changed in a file or in a process's memory, a TCP link cut or slowed), never a flag the
runtime reads."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from phalanx.runtime.base import MemberRecord, node_name

FAMILIES = ("availability", "liveness", "storage", "communication", "numerical")
TARGETS = ("rank", "node", "role", "none")   # what ``FaultSpec`` must name
MECHANISM_MODULES = ("phalanx.launcher.drills.faults.process", "phalanx.launcher.drills.faults.storage",
                     "phalanx.launcher.drills.faults.network", "phalanx.launcher.drills.faults.services",
                     "phalanx.launcher.drills.faults.memory", "phalanx.launcher.drills.faults.partition",
                     "phalanx.launcher.drills.faults.capacity")


@dataclass(frozen=True)
class TierPrecondition:
    """``trigger.after_tier_commit``: a step fault fires only once ``tier`` holds ``step``
    committed for this run, waiting (the ranks held at the fault's gate) at most
    ``within_s`` (<= 15 s: a held rank goes on after 20 s); past that it fires anyway
    and its event says the precondition was unmet."""

    tier: str
    step: int
    within_s: float = 15.0

    def text(self) -> str:
        return f"once {self.tier} holds step {self.step} committed (up to {self.within_s:g} s)"


@dataclass(frozen=True)
class FaultSpec:
    """One fault of a scenario: kind, target (rank, node or role) and trigger (``at_step``
    of the furthest rank, ``at_time_s`` after the first step, or ``probability`` per step
    over ``steps`` = (first, last), drawn with ``seed``; ``at_step`` may wait for
    ``after_tier_commit``), plus kind-specific ``params``."""

    kind: str
    index: int = 0                       # position in the scenario (faults[index])
    rank: int | None = None
    node: int | None = None
    role: str | None = None
    at_step: int | None = None
    at_time_s: float | None = None
    probability: float | None = None
    steps: tuple[int, int] | None = None
    seed: int = 0
    params: Mapping[str, Any] = field(default_factory=dict)
    after_tier_commit: TierPrecondition | None = None

    def target_text(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank}"
        if self.node is not None:
            return node_name(self.node)
        return self.role or "job"

    def trigger_text(self) -> str:
        if self.at_step is not None:
            after = f" {self.after_tier_commit.text()}" if self.after_tier_commit else ""
            return f"at step {self.at_step}{after}"
        if self.at_time_s is not None:
            return f"{self.at_time_s:g} s after the first step"
        assert self.steps is not None
        return f"p={self.probability:g} per step over steps {self.steps[0]}..{self.steps[1]}"


class FaultEnv(Protocol):
    """What a mechanism may touch in the live job; implemented by the launcher
    (``phalanx.launcher.drills.env.JobFaultEnv``). Every method is called from the launcher's main
    thread; so does what they hand to ``later``, once it is due (or when the job ends)."""

    run_dir: Path
    shm_dir: str
    job: str

    def members(self) -> Mapping[str, MemberRecord]: ...
    def rank_pid(self, rank: int) -> int | None: ...
    def node_pids(self, node: int) -> list[int]: ...
    def remove_node(self, node: int) -> None: ...
    def keeper_pid(self, node: int) -> int | None: ...
    def keeper_actor(self, node: int) -> Any: ...     # the node's KeeperActor (None: gone)
    def keeper_address(self, node: int) -> tuple[str, int]: ...
    def keeper_route(self, node: int, address: tuple[str, int] | None) -> None: ...
    def spare_pids(self) -> dict[str, int]: ...
    def config(self) -> Any: ...                      # the job's PhalanxConfig
    def service(self, name: str) -> Any: ...          # "etcd" (EmbeddedEtcd), "s3_proxy", ...
    def later(self, seconds: float, action: Callable[[], None]) -> None: ...
    def emit(self, event: str, **fields: Any) -> None: ...


Fire = Callable[[FaultSpec, FaultEnv], Mapping[str, Any]]


@dataclass(frozen=True)
class Mechanism:
    """A fault kind. ``fire`` injects it and returns what it did (pids, files, bytes) for
    the report. ``params``: name -> (type, default; ``None`` = required). ``recovers``:
    whether a recovery follows ("replace" a rank, "rollback" every rank, "none" needed
    (the run only slows or a copy is repaired), "fail" = ends the job cleanly), what the
    report checks; ``response``: what phalanx does about it, in words (``drill list``);
    the chaos campaign draws only recoverable kinds (``chaos``)."""

    kind: str
    family: str
    target: str
    fire: Fire
    summary: str
    params: Mapping[str, tuple[type, Any]] = field(default_factory=dict)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)   # allowed values
    roles: tuple[str, ...] = ()
    recovers: str = "replace"
    chaos: bool = False
    needs: tuple[str, ...] = ()            # services the job must run: "s3", "standby"
    ends_launcher: bool = False            # fire() never returns (the event goes first)
    response: str = ""                     # what phalanx does about it (``drill list``)


REGISTRY: dict[str, Mechanism] = {}
Prepare = Callable[[Any, set[str]], tuple[Any, dict[str, Any]]]
PREPARERS: list[Prepare] = []


def register(mechanism: Mechanism) -> Mechanism:
    assert mechanism.family in FAMILIES and mechanism.target in TARGETS, mechanism
    REGISTRY[mechanism.kind] = mechanism
    return mechanism


def register_preparer(prepare: Prepare) -> Prepare:
    """``prepare(cfg, kinds) -> (cfg, services)``: run before the job starts when a
    scenario has faults that need something in place first (a proxy in front of S3, a small
    filesystem to fill); the services it returns are closed when the job ends."""
    PREPARERS.append(prepare)
    return prepare


def prepare_job(cfg: Any, kinds: set[str]) -> tuple[Any, dict[str, Any]]:
    """Every registered preparer in turn; returns the config to run and the services the
    scenario's faults act through (``FaultEnv.service``)."""
    catalogue()
    services: dict[str, Any] = {}
    for prepare in PREPARERS:
        cfg, more = prepare(cfg, kinds)
        services.update(more)
    return cfg, services


def catalogue() -> dict[str, Mechanism]:
    """Every registered fault kind (importing the mechanism modules registers them)."""
    for name in MECHANISM_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:     # a family module not written yet is simply absent
                raise
    return dict(REGISTRY)
