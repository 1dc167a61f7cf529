"""``phalanx drill chaos``: draw a seeded, bounded sequence of recoverable faults for a job
(same seed, same scenario), write it as an ordinary drill scenario and run it verified
against the fault-free run."""
from __future__ import annotations

import random
from typing import Any


from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.drills.catalogue import catalogue

FIRST_STEP = 10          # no fault before the first snapshots are committed
GAP_STEPS = 8            # steps between faults (a slow recovery holds the next back:
                         # steps do not advance while it runs)
TAIL_STEPS = 15          # steps after the last fault
ROUND_STEPS = 50         # run lengths are rounded up to this, so campaigns share references


def draw_faults(cfg: PhalanxConfig, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` faults the job can recover from, in step order, from ``seed`` alone."""
    draws = random.Random(seed)
    kinds = _eligible(cfg)
    faults = []
    for i in range(count):
        kind = draws.choice(kinds)
        fault: dict[str, Any] = {"kind": kind, "trigger": {"at_step": FIRST_STEP + i * GAP_STEPS}}
        target = catalogue()[kind].target
        if target == "rank":
            fault["target"] = {"rank": draws.randrange(cfg.job.world_size)}
        elif target == "node":
            fault["target"] = {"node": draws.randrange(cfg.job.nodes)}
        elif target == "role":
            fault["target"] = {"role": catalogue()[kind].roles[0]}
        params = _params(kind, draws)
        if params:
            fault["params"] = params
        faults.append(fault)
    return faults


def _eligible(cfg: PhalanxConfig) -> list[str]:
    """Recoverable kinds this job supports: node loss only with a node to spare and a
    replica of every rank, spare faults only with spares, corruption of a replica only
    with replication."""
    kinds = []
    for kind, mech in sorted(catalogue().items()):
        if not mech.chaos or mech.needs:
            continue
        if kind == "kill_node" and (cfg.job.nodes < 3 or not cfg.replication.enabled):
            continue
        if kind == "kill_spare" and cfg.spares.count < 1:
            continue
        kinds.append(kind)
    return kinds


def _params(kind: str, draws: random.Random) -> dict[str, Any]:
    if kind == "hang_worker":      # a pause shorter than detection, or a hang to replace
        return {"for_s": draws.choice([1.0, 0.0])}
    if kind == "slow_worker":
        return {"for_s": 3.0}
    if kind == "corrupt_snapshot":
        return {"where": draws.choice(["own", "replica"])}
    return {}


def chaos_scenario(cfg: PhalanxConfig, count: int, seed: int,
                   max_minutes: float) -> dict[str, Any]:
    faults = draw_faults(cfg, count, seed)
    needed = FIRST_STEP + (count - 1) * GAP_STEPS + TAIL_STEPS
    steps = -(-needed // ROUND_STEPS) * ROUND_STEPS
    return {
        "name": f"chaos-seed{seed}",
        "description": f"{count} random recoverable faults drawn with seed {seed}",
        "overrides": {"job.args.steps": max(steps, int(cfg.job.args.get("steps", 0))),
                      "job.timeout_s": max_minutes * 60},
        "faults": faults,
        "expect": {"outcome": "completes", "final_state": "identical"},
    }
