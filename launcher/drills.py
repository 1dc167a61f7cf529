"""Fault drills: a YAML scenario of real faults (signals to real processes, a real node
removed) injected into a live job when a rank reaches a step, plus the expectations the
drill report is checked against."""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from configs.errors import ConfigError
from runtime.base import MemberRecord

log = logging.getLogger(__name__)
KINDS = ("kill_worker", "hang_worker", "kill_node")
TOP_KEYS = {"name", "description", "faults", "expect"}
EXPECT_KEYS = {"max_recovery_s", "max_lost_steps", "final_state"}


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    at_step: int
    rank: int | None = None
    node: int | None = None
    for_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    faults: tuple[FaultSpec, ...]
    expect: Mapping[str, Any] = field(default_factory=dict)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a drill file; raises ``ConfigError`` naming the file and key."""
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError("drills.scenario", f"cannot be read: {exc}",
                          "point drills.scenario at a YAML file in configs/drills/", source) from None
    if not isinstance(raw, dict):
        raise ConfigError("(root)", "must be a mapping", "see configs/drills/kill_worker.yaml", source)
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(sorted(unknown)[0], "is not a drill key", f"use {sorted(TOP_KEYS)}", source)
    faults = raw.get("faults")
    if not isinstance(faults, list) or not faults:
        raise ConfigError("faults", "must be a non-empty list", "add at least one fault", source)
    expect = raw.get("expect") or {}
    if not isinstance(expect, dict) or set(expect) - EXPECT_KEYS:
        raise ConfigError("expect", f"unknown keys {sorted(set(expect) - EXPECT_KEYS)}",
                          f"use {sorted(EXPECT_KEYS)}", source)
    specs = tuple(_fault(item, f"faults[{i}]", source) for i, item in enumerate(faults))
    return Scenario(str(raw.get("name", Path(path).stem)), str(raw.get("description", "")),
                    specs, expect)


def _fault(item: Any, key: str, source: str) -> FaultSpec:
    if not isinstance(item, dict):
        raise ConfigError(key, "must be a mapping", "write kind/target/trigger", source)
    kind = item.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{key}.kind", f"{kind!r} is not a known fault", f"use one of {KINDS}",
                          source)
    target, trigger = item.get("target") or {}, item.get("trigger") or {}
    at_step = trigger.get("at_step")
    if not isinstance(at_step, int) or at_step < 1:
        raise ConfigError(f"{key}.trigger.at_step", f"{at_step!r} is not a step >= 1",
                          "e.g. trigger: {at_step: 20}", source)
    rank, node = target.get("rank"), target.get("node")
    if kind == "kill_node" and not isinstance(node, int):
        raise ConfigError(f"{key}.target.node", f"{node!r} is not a node index",
                          "e.g. target: {node: 1}", source)
    if kind != "kill_node" and not isinstance(rank, int):
        raise ConfigError(f"{key}.target.rank", f"{rank!r} is not a rank", "e.g. target: {rank: 1}",
                          source)
    return FaultSpec(kind, at_step, rank, node, float(item.get("for_s", 0.0)))


class Injector:
    """Fires each fault once, when its target reaches ``at_step`` (read from the member
    table), from the launcher's main thread. ``remove_node`` kills a virtual node."""

    def __init__(self, scenario: Scenario, remove_node: Callable[[int], None],
                 emit: Callable[..., Any]) -> None:
        self._pending = list(scenario.faults)
        self._remove_node = remove_node
        self._emit = emit
        self.fired: list[dict[str, Any]] = []

    def poll(self, members: Mapping[str, MemberRecord]) -> None:
        if not self._pending:
            return
        furthest = max((m.step for m in members.values() if m.rank >= 0), default=-1)
        for spec in list(self._pending):
            if furthest < spec.at_step:
                continue
            self._pending.remove(spec)
            self._fire(spec, members, furthest)

    def _fire(self, spec: FaultSpec, members: Mapping[str, MemberRecord], step: int) -> None:
        if spec.kind == "kill_node":
            assert spec.node is not None
            pids = [m.pid for m in members.values() if m.node == f"node{spec.node}" and m.pid]
            self._remove_node(spec.node)
            for pid in pids:  # the node's processes die with it
                _signal(pid, signal.SIGKILL)
            self._record(spec, step, pids)
            return
        record = next((m for m in members.values() if m.rank == spec.rank), None)
        if record is None or not record.pid:
            log.warning("event=drill_target_missing rank=%s", spec.rank)
            return
        if spec.kind == "kill_worker":
            _signal(record.pid, signal.SIGKILL)
        else:
            _signal(record.pid, signal.SIGSTOP)
            if spec.for_s > 0:
                threading.Timer(spec.for_s, _signal, (record.pid, signal.SIGCONT)).start()
        self._record(spec, step, [record.pid])

    def _record(self, spec: FaultSpec, step: int, pids: list[int]) -> None:
        fired = {"kind": spec.kind, "rank": spec.rank, "node": spec.node, "step": step,
                 "pids": pids}
        self.fired.append(fired)
        self._emit("drill_fault", **fired)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        log.warning("event=drill_signal_missed pid=%d signal=%d", pid, sig)
