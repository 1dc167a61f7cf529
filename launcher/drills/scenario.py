"""Drill scenarios: a YAML file of faults (kind, target, trigger, params) and the
expectations its report is checked against, validated against the fault catalogue with
errors that name the file, key, value and fix."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from phalanx.configs.errors import ConfigError
from phalanx.configs.introspect import did_you_mean
from phalanx.launcher.drills.catalogue import FaultSpec, Mechanism, TierPrecondition, catalogue

TOP_KEYS = ("name", "description", "overrides", "needs", "faults", "expect")
FAULT_KEYS = ("kind", "target", "trigger", "params")
TRIGGER_KEYS = ("at_step", "at_time_s", "probability", "steps", "seed", "after_tier_commit")
PRECONDITION_KEYS = ("tier", "step", "within_s")
PRECONDITION_TIERS = ("disk", "s3")
# a held rank goes on after drill_hooks.GATE_WAIT_S (20 s); the fault must fire before
MAX_PRECONDITION_WAIT_S = 15.0
EXPECT_KEYS = ("outcome", "error_contains", "max_recovery_s", "max_after_workers_up_s",
               "max_lost_steps",
               "final_state", "recoveries", "restore_source", "detected", "events")
NEEDS = ("s3", "standby", "nodes3")
OUTCOMES = ("completes", "fails")
SOURCES = ("own", "replica", "disk", "s3", "peer")


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    faults: tuple[FaultSpec, ...]
    expect: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Any] = field(default_factory=dict)   # job config keys, as --set
    needs: tuple[str, ...] = ()
    source: str = ""

    def override_args(self) -> list[str]:
        """The scenario's config overrides as ``--set KEY=VALUE`` arguments (JSON values)."""
        return [f"{key}={json.dumps(value)}" for key, value in self.overrides.items()]


def check_targets(scenario: Scenario, world_size: int, nodes: int) -> None:
    """Every fault's rank or node exists in the job the drill runs (``world_size`` ranks on
    ``nodes`` nodes): a fault aimed at no rank would fire nothing and the drill would prove
    nothing. Raises ``ConfigError`` naming the scenario, the fault's key, its target and
    the job's size, before anything starts."""
    for spec in scenario.faults:
        for what, value, size, grow in (("rank", spec.rank, world_size, "job.world_size"),
                                        ("node", spec.node, nodes, "job.nodes")):
            if value is not None and value >= size:
                raise ConfigError(f"faults[{spec.index}].target.{what}",
                                  f"{what} {value} is not in the job ({size} {what}s)",
                                  f"target a {what} in 0..{size - 1}, or drill a job with more "
                                  f"{what}s (--set {grow}=...)", scenario.source)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a drill file; raises ``ConfigError`` naming the file, key and the
    YAML line of the key."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
        raw = yaml.safe_load(text)
        lines = key_lines(yaml.compose(text, Loader=yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError("drills.scenario", f"cannot be read: {exc}",
                          "point at a YAML file such as configs/drills/kill_worker.yaml",
                          source) from None
    try:
        return parse_scenario(raw, source, default_name=Path(path).stem)
    except ConfigError as exc:
        raise exc.located(source, _line_of(exc.key, lines)) from None


def key_lines(node: yaml.Node | None, path: str = "") -> dict[str, int]:
    """1-based YAML line of every key path (``faults[0].kind``) in a composed document."""
    found: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = f"{path}.{key.value}" if path else str(key.value)
            found[child] = key.start_mark.line + 1
            found.update(key_lines(value, child))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            child = f"{path}[{index}]"
            found[child] = item.start_mark.line + 1
            found.update(key_lines(item, child))
    return found


def _line_of(key: str, lines: Mapping[str, int]) -> int | None:
    """The line of ``key``, else of the nearest enclosing key that is in the file."""
    while key:
        if key in lines:
            return lines[key]
        cut = max(key.rfind("."), key.rfind("["))
        key = key[:cut] if cut > 0 else ""
    return None


def parse_scenario(raw: Any, source: str, default_name: str = "drill") -> Scenario:
    if not isinstance(raw, dict):
        raise ConfigError("(root)", "must be a mapping", "see configs/drills/kill_worker.yaml",
                          source)
    _known(raw, TOP_KEYS, "", source)
    faults = raw.get("faults")
    if not isinstance(faults, list) or not faults:
        raise ConfigError("faults", f"{faults!r} is not a non-empty list",
                          "add at least one fault: - {kind: kill_worker, target: {rank: 1}, "
                          "trigger: {at_step: 20}}", source)
    specs = tuple(parse_fault(item, f"faults[{i}]", source, i) for i, item in enumerate(faults))
    expect = _expect(raw.get("expect") or {}, source)
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ConfigError("overrides", f"{overrides!r} is not a mapping of config keys",
                          "e.g. overrides: {spares.count: 2, job.nodes: 3}", source)
    needs = raw.get("needs") or []
    if not isinstance(needs, list) or any(n not in NEEDS for n in needs):
        raise ConfigError("needs", f"{needs!r} is not a list of {list(NEEDS)}",
                          "e.g. needs: [s3]", source)
    return Scenario(str(raw.get("name", default_name)), str(raw.get("description", "")),
                    specs, expect, dict(overrides), tuple(needs), source)


def parse_fault(item: Any, key: str, source: str, index: int = 0) -> FaultSpec:
    """One fault mapping (a scenario item, or what ``phalanx drill inject`` sends)."""
    kinds = catalogue()
    if not isinstance(item, dict):
        raise ConfigError(key, f"{item!r} is not a mapping", "write kind, target, trigger",
                          source)
    _known(item, FAULT_KEYS, key + ".", source)
    kind = item.get("kind")
    if kind not in kinds:
        close = did_you_mean(kind, list(kinds)) if isinstance(kind, str) else ""
        raise ConfigError(f"{key}.kind", f"{kind!r} is not a known fault{close}",
                          f"use one of {', '.join(sorted(kinds))} (phalanx drill list)", source)
    mech = kinds[kind]
    target = _target(item.get("target") or {}, mech, f"{key}.target", source)
    trigger = _trigger(item.get("trigger"), f"{key}.trigger", source)
    params = _params(item.get("params") or {}, mech, f"{key}.params", source)
    return FaultSpec(kind=kind, index=index, params=params, **target, **trigger)


def _known(raw: Mapping[str, Any], allowed: tuple[str, ...], prefix: str, source: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(prefix + unknown[0], "is not a drill key"
                          + did_you_mean(str(unknown[0]), list(allowed)), f"use {list(allowed)}",
                          source)


def _target(raw: Any, mech: Mechanism, key: str, source: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{raw!r} is not a mapping", "e.g. target: {rank: 1}", source)
    want = mech.target
    if want == "none":
        return {}
    value = raw.get(want)
    if want == "role":
        if value not in mech.roles:
            raise ConfigError(f"{key}.role", f"{value!r} is not a role {mech.kind} acts on",
                              f"use target: {{role: {mech.roles[0]}}}", source)
        return {"role": value}
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}.{want}", f"{value!r} is not a {want} index",
                          f"{mech.kind} targets a {want}: e.g. target: {{{want}: 1}}", source)
    return {want: value}


def _trigger(raw: Any, key: str, source: str) -> dict[str, Any]:
    example = "e.g. trigger: {at_step: 20}, {at_time_s: 5} or {probability: 0.1, steps: [10, 40]}"
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{raw!r} is not a mapping", example, source)
    _known(raw, TRIGGER_KEYS, key + ".", source)
    chosen = [k for k in ("at_step", "at_time_s", "probability") if k in raw]
    if len(chosen) != 1:
        raise ConfigError(key, f"names {chosen or 'no trigger'}", "give exactly one of at_step, "
                          f"at_time_s, probability; {example}", source)
    value = raw[chosen[0]]
    if chosen[0] == "at_step":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key}.at_step", f"{value!r} is not a step >= 0 (0: before "
                              "the first step completes)", "e.g. trigger: {at_step: 20}", source)
        after = raw.get("after_tier_commit")
        if after is None:
            return {"at_step": value}
        return {"at_step": value, "after_tier_commit": _precondition(
            after, value, f"{key}.after_tier_commit", source)}
    if "after_tier_commit" in raw:
        raise ConfigError(f"{key}.after_tier_commit", f"is given with {chosen[0]}",
                          "after_tier_commit holds a step fault only: use it with at_step, "
                          "e.g. trigger: {at_step: 30, after_tier_commit: {tier: disk, step: 20}}",
                          source)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}.{chosen[0]}", f"{value!r} is not a number", example, source)
    if chosen[0] == "at_time_s":
        if value < 0:
            raise ConfigError(f"{key}.at_time_s", f"{value!r} is negative", example, source)
        return {"at_time_s": float(value)}
    steps, seed = raw.get("steps"), raw.get("seed", 0)
    if not 0 < value <= 1:
        raise ConfigError(f"{key}.probability", f"{value!r} is not in (0, 1]",
                          "e.g. probability: 0.1", source)
    if (not isinstance(steps, list) or len(steps) != 2 or not all(
            isinstance(s, int) and s >= 1 for s in steps) or steps[0] > steps[1]):
        raise ConfigError(f"{key}.steps", f"{steps!r} is not [first, last] steps >= 1",
                          "e.g. steps: [10, 40]", source)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{key}.seed", f"{seed!r} is not an integer", "e.g. seed: 7", source)
    return {"probability": float(value), "steps": (steps[0], steps[1]), "seed": seed}


def _precondition(raw: Any, at_step: int, key: str, source: str) -> TierPrecondition:
    """``trigger.after_tier_commit``: {tier: disk|s3, step: S <= at_step, within_s: 15}."""
    example = "e.g. after_tier_commit: {tier: disk, step: 20, within_s: 15}"
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{raw!r} is not a mapping", example, source)
    _known(raw, PRECONDITION_KEYS, key + ".", source)
    tier, step = raw.get("tier"), raw.get("step")
    within = raw.get("within_s", MAX_PRECONDITION_WAIT_S)
    if tier not in PRECONDITION_TIERS:
        raise ConfigError(f"{key}.tier", f"{tier!r} is not a tier",
                          f"use one of {list(PRECONDITION_TIERS)}; {example}", source)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= at_step:
        raise ConfigError(f"{key}.step", f"{step!r} is not a step in [0, at_step={at_step}]",
                          f"name the tier checkpoint the fault needs; {example}", source)
    if not _number(within) or not 0 < within <= MAX_PRECONDITION_WAIT_S:
        raise ConfigError(f"{key}.within_s", f"{within!r} is not a number of seconds in "
                          f"(0, {MAX_PRECONDITION_WAIT_S:g}]", "bound the wait below the 20 s "
                          f"a rank stays held at a drill gate; {example}", source)
    return TierPrecondition(str(tier), step, float(within))


def _params(raw: Any, mech: Mechanism, key: str, source: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{raw!r} is not a mapping", "e.g. params: {for_s: 2}", source)
    unknown = sorted(set(raw) - set(mech.params))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"is not a parameter of {mech.kind}",
                          f"use {sorted(mech.params) or 'no params'}", source)
    values = {}
    for name, (kind, default) in mech.params.items():
        value = raw.get(name, default)
        if value is None:
            raise ConfigError(f"{key}.{name}", "is missing", f"{mech.kind} needs {name}", source)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"{key}.{name}", f"{value!r} is not a {kind.__name__}",
                              f"e.g. {name}: {default!r}", source)
        allowed = mech.choices.get(name)
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{key}.{name}", f"{value!r} is not allowed for {mech.kind}",
                              f"use one of {list(allowed)}", source)
        values[name] = value
    return values


def _expect(raw: Any, source: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError("expect", f"{raw!r} is not a mapping",
                          "e.g. expect: {max_lost_steps: 1, final_state: identical}", source)
    _known(raw, EXPECT_KEYS, "expect.", source)
    checks = {
        "outcome": (lambda v: v in OUTCOMES, f"one of {list(OUTCOMES)}"),
        "error_contains": (lambda v: isinstance(v, str) and v, "a non-empty string"),
        "max_recovery_s": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
        "max_after_workers_up_s": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
        "max_lost_steps": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
        "final_state": (lambda v: v in ("identical", "any"), "identical or any"),
        "recoveries": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
        "restore_source": (lambda v: v in SOURCES, f"one of {list(SOURCES)}"),
        "detected": (lambda v: isinstance(v, str) and v, "a fault kind, e.g. worker_died"),
        "events": (lambda v: isinstance(v, list) and all(isinstance(e, str) and e for e in v),
                   "a list of event names that must appear, e.g. [tier_degraded]"),
    }
    for name, value in raw.items():
        ok, wanted = checks[name]
        if not ok(value):
            raise ConfigError(f"expect.{name}", f"{value!r} is not {wanted}",
                              f"write expect.{name} as {wanted}", source)
    return dict(raw)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def probability_step(spec: FaultSpec) -> int | None:
    """The step a probabilistic fault fires at: each step of ``spec.steps`` draws once with
    ``probability`` from a generator seeded by (seed, index), so a scenario always fires at
    the same step; None when no draw hits."""
    assert spec.probability is not None and spec.steps is not None
    draws = random.Random(f"{spec.seed}:{spec.index}:{spec.kind}")
    for step in range(spec.steps[0], spec.steps[1] + 1):
        if draws.random() < spec.probability:
            return step
    return None
