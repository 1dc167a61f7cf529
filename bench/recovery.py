#!/usr/bin/env python
"""Recovery time: real faults injected into real ``phalanx launch`` runs, fault to first step.

For each cell (fault kind, world size, parameter MiB per rank) and each repeat, this runs
``python -m phalanx.launcher.cli launch configs/demo.yaml --set ...`` as a subprocess, the way a user
does, with:

* the job ``examples/train_state.py:main`` — deterministic data-parallel training whose
  parameters total ``--sizes-mb`` MiB per rank (SGD momentum doubles the snapshot; the
  exact snapshot bytes each rank's keeper slot holds are read from the worker logs);
* ``job.nodes`` 2 (3 for ``kill_node`` at world >= 4), as many virtual Ray nodes, 8 logical
  CPUs per node, one warm spare, ``job.run_dir`` in a temp dir, ``snapshot.rank_size_mb``
  set so the launcher refuses a job whose snapshots do not fit shared memory;
* a drill scenario written to a temp dir: ``kill_worker`` / ``hang_worker`` of rank 1, or
  ``kill_node`` of node 1 (the spare lives on node 0), at step ``--fault-step``.

From ``<run dir>/events.jsonl`` it reads the ``drill_fault`` event (when the fault was
injected) and the ``recovered`` event (``first_step_at``, ``fault_to_first_step_s``,
``phases_s``, ``lost_steps``) and derives, per run:

* kill→first step = ``first_step_at`` − drill_fault time (what the targets are checked on);
* fault→first step = the coordinator's ``fault_to_first_step_s`` (from when it observed the
  fault signal);
* phases: notice (injection → coordinator observed the signal), detect (``detect`` +
  ``detecting``), plan (``planning``), fence (``fencing``), promote (``promoting``),
  restore (the rest up to the first completed step of the new generation). The raw
  ``phases_s`` are kept too.

A run that fails (non-zero exit, no ``recovered`` event, timeout) is recorded as failed
with the tail of its output; the bench goes on. Unless ``--no-reference``, one fault-free
run per (world, size) gives the reference parameter hash every faulted run must match
(bit-identical replay).

Writes ``<out>/recovery.json`` (every run + medians per cell) and ``<out>/recovery.png``
(stacked phases per cell, when matplotlib is importable), prints a markdown table and
PASS/MISS per target; a missed target or a failed run never fails the process.
"""
from __future__ import annotations

import argparse
import calendar
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from phalanx.runtime.keeper.shm import mem_available  # noqa: E402
from bench.common import (machine_info, markdown_table, median, progress, verdict,  # noqa: E402
                          write_json)

SCHEMA_VERSION = 1
CONFIG = "configs/demo.yaml"
ENTRYPOINT = "examples/train_state.py:main"
FAULTS = ("kill_worker", "kill_node", "hang_worker")
PHASES = ("notice", "detect", "plan", "fence", "promote", "restore")
TARGET_RANK = 1          # on node 1 (ranks go round robin); the spare starts on node 0
TARGET_NODE = 1
CPUS_PER_NODE = 8        # Ray CPUs are logical: enough for world 8 + a spare at 0.5 each
TARGETS = {"kill_worker_64MiB_world4_max_s": 1.0, "kill_node_max_s": 2.0,
           "hang_worker_over_stall_timeout_max_s": 1.0}
LOG_RE = re.compile(r"rank (\d+) parameter bytes (\d+) snapshot bytes (\d+) big layers (\d+) "
                    r"median step s ([0-9.eE+-]+)")
HASH_RE = re.compile(r"rank (\d+) final parameter hash ([0-9a-f]{64})")
LAYOUT_RE = re.compile(r"event=snapshot_layout rank=(\d+) bytes=(\d+)")
RESTORED_RE = re.compile(r"event=rank_restored rank=(\d+) step=(\d+) source='([^']*)' "
                         r"bytes=(\d+) seconds=([0-9.]+)")
STAMP_RE = r"^ts=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z .*?"   # logfmt (runtime.logs)
RUN_AT_RE = re.compile(STAMP_RE + r"event=worker_run ", re.M)
START_AT_RE = re.compile(STAMP_RE + r"event=session_start ", re.M)
RESTORED_AT_RE = re.compile(STAMP_RE + r"event=rank_restored ", re.M)
FORMED_RE = re.compile(STAMP_RE + r"event=group_formed generation=([1-9]\d*) .*seconds=([0-9.]+)",
                       re.M)


# -- what fits this machine -----------------------------------------------------------------
# Host bytes per byte of parameters, per rank: the worker's parameters, gradients and SGD
# momentum (3); its keeper's two slots of a snapshot twice the parameters (4); the replicas
# another keeper holds of it (factor 1, two steps kept: 4). Plus one spare restoring a rank.
BYTES_PER_PARAM_BYTE = 11
# Of MemAvailable a cell may plan to use. Calibrated on the 23 GB CI VM, where Ray's memory
# monitor killed workers (it acts at 95 % of RAM) in cells estimated at 13.75 GiB (256 MiB
# x world 4) and 16.5 GiB (512 MiB x world 2), while 8.25 GiB (256 MiB x world 2) ran: the
# estimate misses allocator, page-cache and per-process overheads by about 1.5x.
FIT_SHARE = 0.55


def host_bytes_needed(world: int, state_mib: float) -> int:
    per_rank = state_mib * 2**20 * BYTES_PER_PARAM_BYTE
    return int(per_rank * (world + 1))


def unfit_reason(world: int, state_mib: float, available: int | None) -> str | None:
    """Why a cell cannot run on this machine (its state does not fit in memory), or None."""
    need = host_bytes_needed(world, state_mib)
    if available is None or need <= available * FIT_SHARE:
        return None
    return (f"needs ~{need / 2**30:.1f} GiB of host memory (parameters, gradients, momentum, "
            f"keeper slots and replicas for {world} ranks + a spare at {state_mib:g} MiB), "
            f"over {FIT_SHARE:.0%} of the {available / 2**30:.1f} GiB available")


# -- one run -----------------------------------------------------------------------------
def nodes_for(fault: str, world: int) -> int:
    return 3 if fault == "kill_node" and world >= 4 else 2


def scenario_yaml(fault: str, at_step: int) -> str:
    target = f"{{node: {TARGET_NODE}}}" if fault == "kill_node" else f"{{rank: {TARGET_RANK}}}"
    return (f"name: bench_{fault}\n"
            f"description: bench/recovery.py {fault} at step {at_step}\n"
            f"faults:\n  - kind: {fault}\n    target: {target}\n"
            f"    trigger: {{at_step: {at_step}}}\n")


def overrides_for(args: argparse.Namespace, world: int, nodes: int, state_mb: float,
                  run_root: Path, scenario: Path | None) -> list[str]:
    job_args = {"steps": args.steps, "state_mb": state_mb, "seed": args.seed,
                "sleep_per_step_s": args.sleep_per_step}
    sets = [f"job.run_dir={run_root}",
            f"job.entrypoint={ROOT / ENTRYPOINT}",
            "job.name=bench-recovery",
            f"job.world_size={world}",
            f"job.nodes={nodes}",
            f"job.timeout_s={args.run_timeout}",
            f"job.args={json.dumps(job_args)}",
            f"ray.virtual_nodes={nodes}",
            f"ray.cpus_per_node={CPUS_PER_NODE}",
            "spares.count=1",
            # momentum doubles the parameters; a little room for RNG and small tensors
            f"snapshot.rank_size_mb={2 * state_mb + 1}"]
    if scenario is not None:
        sets.append(f"drills.scenario={scenario}")
    return sets + list(args.set)


def stall_timeout_s(overrides: Sequence[str]) -> float:
    from phalanx.configs.loader import load_config
    return float(load_config(str(ROOT / CONFIG), list(overrides)).detection.stall_timeout_s)


def launch(overrides: Sequence[str], timeout_s: float, config: Path = ROOT / CONFIG,
           on_start: Callable[[subprocess.Popen], None] | None = None,
           ) -> tuple[int | None, str, str, float]:
    """Run ``phalanx launch CONFIG``; returns (exit code or None on timeout, stdout, stderr,
    seconds). ``on_start`` gets the process as soon as it runs (a watcher's hook)."""
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "launch", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _CHILDREN.add(proc)
    if on_start is not None:
        on_start(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        code = None
    finally:
        _CHILDREN.discard(proc)
    return code, stdout or "", stderr or "", time.monotonic() - started


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM unwinds the launcher (it stops Ray, etcd, keepers); SIGKILL if it hangs."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        return proc.communicate()


_CHILDREN: set[subprocess.Popen] = set()


def read_events(run_root: Path) -> tuple[Path | None, list[dict[str, Any]]]:
    runs = [p for p in run_root.iterdir() if p.is_dir() and (p / "events.jsonl").exists()] \
        if run_root.is_dir() else []
    if not runs:
        return None, []
    run_dir = max(runs, key=lambda p: p.stat().st_mtime)
    events = []
    for line in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return run_dir, events


def read_logs(run_dir: Path | None) -> dict[str, Any]:
    """Snapshot size, step time and restore transfers from the worker logs."""
    out: dict[str, Any] = {"snapshot_bytes": {}, "parameter_bytes": None, "big_layers": None,
                           "median_step_s": {}, "restores": [], "replacements": []}
    if run_dir is None or not (run_dir / "logs").is_dir():
        return out
    for log in sorted((run_dir / "logs").iterdir()):
        text = log.read_text(encoding="utf-8", errors="replace")
        for rank, nbytes in LAYOUT_RE.findall(text):
            out["snapshot_bytes"][int(rank)] = int(nbytes)  # the last layout is the one held
        for rank, params, snap, layers, step_s in LOG_RE.findall(text):
            out["parameter_bytes"], out["big_layers"] = int(params), int(layers)
            out["snapshot_bytes"][int(rank)] = int(snap)
            out["median_step_s"][log.stem] = float(step_s)
        if "-g0" not in log.stem:  # a replacement (spare or restarted worker): its timeline
            out["replacements"].append(replacement_timeline(log.stem, text))
        for rank, step, source, nbytes, seconds in RESTORED_RE.findall(text):
            out["restores"].append({"worker": log.stem, "rank": int(rank), "step": int(step),
                                    "source": source, "bytes": int(nbytes),
                                    "seconds": float(seconds)})
    return out


def _stamp(text: str) -> float:
    """A log line's ``ts`` (UTC, ms) as epoch seconds."""
    return calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")) + int(text[20:23]) / 1000


def replacement_timeline(worker: str, text: str) -> dict[str, Any]:
    """Wall-clock epochs of a replacement worker: entrypoint started (``run_at``), session
    started (model built), snapshot restored, new group formed."""
    timeline: dict[str, Any] = {"worker": worker}
    for key, pattern in (("run_at", RUN_AT_RE), ("session_start_at", START_AT_RE),
                         ("restored_at", RESTORED_AT_RE)):
        found = pattern.search(text)
        timeline[key] = _stamp(found.group(1)) if found else None
    formed = FORMED_RE.search(text)
    timeline["group_formed_at"] = _stamp(formed.group(1)) if formed else None
    timeline["group_form_s"] = float(formed.group(3)) if formed else None
    return timeline


def phases_of(record: dict[str, Any], kill_to_first: float) -> dict[str, float]:
    raw = record.get("phases_s") or {}
    fault_to_first = float(record["fault_to_first_step_s"])
    phases = {"notice": kill_to_first - fault_to_first,
              "detect": float(raw.get("detect", 0.0)) + float(raw.get("detecting", 0.0)),
              "plan": float(raw.get("planning", 0.0)),
              "fence": float(raw.get("fencing", 0.0)),
              "promote": float(raw.get("promoting", 0.0))}
    phases["restore"] = fault_to_first - sum(phases[k] for k in PHASES[1:5])
    return {k: round(v, 4) for k, v in phases.items()}


def tail(text: str, chars: int = 2500) -> str:
    return text[-chars:].strip()


def run_one(args: argparse.Namespace, work: Path, fault: str | None, world: int,
            state_mb: float, repeat: int) -> dict[str, Any]:
    nodes = nodes_for(fault or "", world)
    name = f"{fault or 'reference'}-w{world}-{state_mb:g}mb-{repeat}"
    run_root = work / name
    run_root.mkdir(parents=True)
    scenario = None
    if fault is not None:
        scenario = work / f"{name}.yaml"
        scenario.write_text(scenario_yaml(fault, args.fault_step), encoding="utf-8")
    overrides = overrides_for(args, world, nodes, state_mb, run_root, scenario)
    result: dict[str, Any] = {"fault": fault, "world": world, "state_mib": state_mb,
                              "repeat": repeat, "nodes": nodes, "spares": 1,
                              "fault_step": args.fault_step if fault else None,
                              "steps": args.steps, "ok": False,
                              "loadavg_before": list(os.getloadavg())}
    code, stdout, stderr, seconds = launch(overrides, args.run_timeout + 90)
    result.update({"returncode": code, "launch_s": round(seconds, 2),
                   "loadavg_after": list(os.getloadavg())})
    run_dir, events = read_events(run_root)
    logs = read_logs(run_dir)
    hashes = {int(r): h for r, h in HASH_RE.findall(stdout)}
    snapshot_bytes = sorted(set(logs["snapshot_bytes"].values()))
    step_times = list(logs["median_step_s"].values())
    result.update({"run_dir": str(run_dir) if run_dir else None,
                   "hash": hashes.get(0), "ranks_agree": len(set(hashes.values())) == 1,
                   "parameter_bytes": logs["parameter_bytes"], "big_layers": logs["big_layers"],
                   "snapshot_bytes": snapshot_bytes[-1] if snapshot_bytes else None,
                   "snapshot_bytes_per_rank": {str(k): v for k, v in
                                               sorted(logs["snapshot_bytes"].items())},
                   "median_step_s": round(median(step_times), 4) if step_times else None,
                   "restores": logs["restores"]})
    errors = []
    if code is None:
        errors.append(f"timed out after {args.run_timeout + 90:.0f} s (stopped with SIGTERM)")
    elif code != 0:
        errors.append(f"phalanx launch exited {code}")
    if code == 0 and len(hashes) != world:
        errors.append(f"{len(hashes)} of {world} ranks printed a final hash")
    if code == 0 and not result["ranks_agree"]:
        errors.append("ranks ended with different parameters")
    if fault is not None:
        fired = [e for e in events if e.get("event") == "drill_fault"]
        fired_at = float(fired[0]["time"]) if fired else math.inf
        recovered = [e for e in events if e.get("event") == "recovered"]
        # faults the coordinator acted on before the drill fired (e.g. a false stall)
        spurious = [e for e in events if e.get("event") == "fault"
                    and float(e.get("time", 0)) < fired_at]
        after = [e for e in recovered if float(e.get("time", 0)) > fired_at
                 and float(e.get("first_step_at", 0)) > fired_at]
        result["recoveries"] = len(recovered)
        result["spurious_faults"] = [{"kind": e.get("kind"), "ranks": e.get("ranks"),
                                      "evidence": e.get("evidence")} for e in spurious]
        if not fired:
            errors.append("the drill fault never fired")
        if spurious:
            errors.append(f"{len(spurious)} fault(s) before the drill fired: "
                          f"{spurious[0].get('evidence')}")
        if fired and not after:
            errors.append("no recovered event after the drill fault")
        if fired and after:
            record = after[0]
            kill_to_first = float(record["first_step_at"]) - float(fired[0]["time"])
            result.update({
                "fired_at_step": fired[0].get("step"),
                "detected_as": record.get("fault"), "generation": record.get("generation"),
                "restore_step": record.get("restore_step"),
                "fault_to_first_step_s": float(record["fault_to_first_step_s"]),
                "kill_to_first_step_s": round(kill_to_first, 4),
                "lost_steps": record.get("lost_steps"),
                "phases": phases_of(record, kill_to_first),
                "phases_s_raw": record.get("phases_s")})
            result["replacements"] = [
                {key: (round(value - fired_at, 3) if key.endswith("_at") and value else value)
                 for key, value in item.items()} for item in logs["replacements"]]
            if kill_to_first <= 0 or float(record["fault_to_first_step_s"]) <= 0:
                errors.append("non-positive recovery time")
    result["ok"] = not errors
    if errors:
        result["error"] = "; ".join(errors)
        result["output_tail"] = tail(stderr) + ("\n--- stdout ---\n" + tail(stdout, 800)
                                                if stdout.strip() else "")
    if not args.keep_runs:
        shutil.rmtree(run_root, ignore_errors=True)
    return result


# -- aggregation ---------------------------------------------------------------------------
def med(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return round(statistics.median(values), 4) if values else None


def summarize(cell: dict[str, Any], runs: list[dict[str, Any]],
              reference: dict[str, Any] | None) -> dict[str, Any]:
    ok = [r for r in runs if r["ok"]]
    out = dict(cell)
    out.setdefault("skipped", None)
    out.update({"runs": len(runs), "ok_runs": len(ok),
                "kill_to_first_step_s": med([r["kill_to_first_step_s"] for r in ok]),
                "fault_to_first_step_s": med([r["fault_to_first_step_s"] for r in ok]),
                "phases": {p: med([r["phases"][p] for r in ok]) for p in PHASES},
                "lost_steps": med([r["lost_steps"] for r in ok]),
                "snapshot_bytes": med([r["snapshot_bytes"] for r in runs]),
                "median_step_s": med([r["median_step_s"] for r in runs]),
                "hashes_agree": len({r["hash"] for r in ok}) <= 1,
                "runs_with_spurious_faults": sum(1 for r in runs if r.get("spurious_faults")),
                "loadavg1_median": med([r["loadavg_before"][0] for r in runs]),
                "errors": [r["error"] for r in runs if not r["ok"]]})
    if reference is not None and reference.get("ok"):
        out["identical_to_fault_free"] = all(r["hash"] == reference["hash"] for r in ok) \
            if ok else None
    else:
        out["identical_to_fault_free"] = None
    return out


def targets_of(cells: list[dict[str, Any]], stall_s: dict[str, float]) -> list[dict[str, Any]]:
    found = []
    for cell in cells:
        value, fault = cell["kill_to_first_step_s"], cell["fault"]
        if cell.get("skipped"):
            continue
        # the "64 MiB per rank" is the rank's state: 32 MiB of parameters + momentum
        if fault == "kill_worker" and cell["world"] == 4 and cell["state_mib"] == 32:
            limit, name = TARGETS["kill_worker_64MiB_world4_max_s"], "kill-worker <= 1 s"
        elif fault == "kill_node":
            limit, name = TARGETS["kill_node_max_s"], "node loss <= 2 s"
        elif fault == "hang_worker":
            limit = stall_s[cell["key"]] + TARGETS["hang_worker_over_stall_timeout_max_s"]
            name = f"hang <= stall_timeout_s + 1 s = {limit:g} s"
        else:
            continue
        found.append({"target": name, "cell": cell["key"], "limit_s": limit,
                      "kill_to_first_step_s": value,
                      "verdict": verdict(value is not None and value <= limit)})
    return found


def table(cells: list[dict[str, Any]]) -> str:
    headers = ["fault", "world", "MiB/rank", "snapshot MiB", "kill→first step s",
               "fault→first step s", "detect", "plan", "fence", "promote", "restore",
               "lost steps", "step s", "ok/total"]
    rows = []
    for c in cells:
        snap = c["snapshot_bytes"] / 2**20 if c["snapshot_bytes"] else None
        ph = c["phases"]
        rows.append([c["fault"], c["world"], f"{c['state_mib']:g}",
                     round(snap, 2) if snap else None, c["kill_to_first_step_s"],
                     c["fault_to_first_step_s"], ph["detect"], ph["plan"], ph["fence"],
                     ph["promote"], ph["restore"], c["lost_steps"], c["median_step_s"],
                     "skipped: no room" if c.get("skipped") else f"{c['ok_runs']}/{c['runs']}"])
    return markdown_table(headers, rows)


def plot(path: Path, cells: list[dict[str, Any]]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress(f"matplotlib is not installed: skipped {path}")
        return False
    labels = [f"{c['fault']}\nw{c['world']} {c['state_mib']:g} MiB" for c in cells]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cells) + 2), 5))
    bottoms = [0.0] * len(cells)
    for phase in PHASES:
        values = [max(0.0, c["phases"][phase] or 0.0) for c in cells]
        ax.bar(range(len(cells)), values, 0.6, bottom=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    totals = [(i, c["kill_to_first_step_s"]) for i, c in enumerate(cells)
              if c["kill_to_first_step_s"] is not None]
    if totals:  # the phase medians need not add up to the median total: mark it
        ax.scatter([i for i, _ in totals], [v for _, v in totals], marker="_", s=900,
                   color="black", zorder=3, label="median kill→first step")
    for i, c in enumerate(cells):
        if c["kill_to_first_step_s"] is None:
            ax.text(i, 0, "skipped" if c.get("skipped") else "failed", ha="center",
                    va="bottom", color="gray" if c.get("skipped") else "red")
    ax.set_xticks(range(len(cells)), labels, fontsize=8)
    ax.set_ylabel("seconds (median), fault injected → first step")
    ax.set_title("phalanx recovery phases per cell")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one cell: kill_worker, world 2, 16 MiB, 1 repeat, no reference run")
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--sizes-mb", default="32,256",
                   help="parameter MiB per rank; the state (parameters + SGD momentum) is "
                   "twice that: 32 and 256 give the issue's 64 and 512 MiB of state per rank")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--fault-step", type=int, default=10, help="step the fault fires at")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--sleep-per-step", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=300.0, help="job.timeout_s of a run")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the fault-free run per (world, size) that hashes are checked on")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.worlds, args.sizes_mb, args.faults, args.repeats = "2", "16", "kill_worker", 1
        args.no_reference = True
    args.world_list = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.size_list = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    args.fault_list = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in args.fault_list if f not in FAULTS]
    if bad:
        p.error(f"unknown fault(s) {bad}; use {list(FAULTS)}")
    if not 1 <= args.fault_step < args.steps:
        p.error("--fault-step must be >= 1 and below --steps")
    if any(w < 2 for w in args.world_list):
        p.error("world sizes must be >= 2 (two nodes)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    available = mem_available()
    cells = [{"fault": f, "world": w, "state_mib": s, "key": f"{f}/w{w}/{s:g}MiB",
              "skipped": unfit_reason(w, s, available)}
             for f in args.fault_list for w in args.world_list for s in args.size_list]
    for cell in cells:
        if cell["skipped"]:
            progress(f"skipping {cell['key']}: {cell['skipped']}")
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-recovery-"))
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    references: dict[tuple[int, float], dict[str, Any]] = {}
    stall_s: dict[str, float] = {}
    interrupted = False
    runnable = [c for c in cells if not c["skipped"]]
    total = len(runnable) * args.repeats + (0 if args.no_reference else
                                            len({(c["world"], c["state_mib"]) for c in runnable}))
    progress(f"recovery bench: {len(cells)} cell(s) x {args.repeats} repeat(s), "
             f"{total} launches; work dir {work}")
    try:
        for cell in runnable:
            stall_s[cell["key"]] = stall_timeout_s(overrides_for(
                args, cell["world"], nodes_for(cell["fault"], cell["world"]),
                cell["state_mib"], work, None))
            ref_key = (cell["world"], cell["state_mib"])
            if not args.no_reference and ref_key not in references:
                ref = run_one(args, work, None, cell["world"], cell["state_mib"], 0)
                references[ref_key] = ref
                progress(f"[{len(runs) + len(references)}/{total}] reference world "
                         f"{cell['world']} {cell['state_mib']:g} MiB: " + (
                             f"ok in {ref['launch_s']:.0f} s, snapshot "
                             f"{(ref['snapshot_bytes'] or 0) / 2**20:.2f} MiB/rank, step "
                             f"{ref['median_step_s']} s" if ref["ok"]
                             else f"FAILED: {ref.get('error')}"))
            for repeat in range(args.repeats):
                run = run_one(args, work, cell["fault"], cell["world"], cell["state_mib"],
                              repeat)
                run["key"] = cell["key"]
                runs.append(run)
                where = (f"[{len(runs) + len(references)}/{total}] {cell['fault']} world "
                         f"{cell['world']} {cell['state_mib']:g} MiB #{repeat + 1}")
                if run["ok"]:
                    progress(f"{where}: kill→first step {run['kill_to_first_step_s']:.3f} s "
                             f"(fault→first {run['fault_to_first_step_s']:.3f} s, detected as "
                             f"{run['detected_as']}, lost {run['lost_steps']}) run "
                             f"{run['launch_s']:.0f} s")
                else:
                    last = (run.get("output_tail") or "").strip().splitlines()[-1:] or [""]
                    progress(f"{where}: FAILED ({run['error']}) {last[0][:160]}")
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: report what was measured so far
        interrupted = True
        progress("interrupted: writing the runs measured so far")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    # an interrupt may leave some unrun; cells that do not fit are reported as skipped
    cells = [c for c in cells if c["key"] in stall_s or c["skipped"]]
    summaries = [summarize(cell, [r for r in runs if r["key"] == cell["key"]],
                           references.get((cell["world"], cell["state_mib"])))
                 for cell in cells]
    targets = targets_of(summaries, stall_s)
    png = out / "recovery.png"
    drawn = plot(png, summaries)
    report = {
        "bench": "recovery", "schema_version": SCHEMA_VERSION, "quick": args.quick,
        "interrupted": interrupted,
        "config": CONFIG, "entrypoint": ENTRYPOINT, "faults": args.fault_list,
        "worlds": args.world_list, "sizes_mib": args.size_list, "repeats": args.repeats,
        "fault_step": args.fault_step, "steps": args.steps,
        "sleep_per_step_s": args.sleep_per_step, "extra_overrides": list(args.set),
        "stall_timeout_s": stall_s, "targets": TARGETS, "verdicts": targets,
        "machine": machine_info(), "seconds": round(time.monotonic() - started, 1),
        "png": str(png) if drawn else None,
        "notes": [
            "kill→first step = recovered.first_step_at - drill_fault.time (wall clock); the "
            "targets are checked on it. fault→first step = the coordinator's "
            "fault_to_first_step_s, counted from when it observed the fault signal.",
            "phases: notice = kill→first - fault→first; detect = phases_s.detect + "
            "phases_s.detecting; plan/fence/promote = planning/fencing/promoting; restore = "
            "the rest up to the first completed step (includes the spare building the "
            "model, restoring the snapshot and re-forming the group).",
            "replacements: per replacement worker, seconds after the fault was injected at "
            "which its entrypoint started (run_at), its session started, i.e. the model was "
            "built (session_start_at), its snapshot was restored and its new group formed.",
            "snapshot_bytes: the keeper slot size of each rank's snapshot as the snapshotter "
            "laid it out (parameters + SGD momentum + RNG and small state).",
            "The 2-core machine is shared: loadavg_before/after of each run show the load.",
        ],
        "cells": summaries, "references": list(references.values()), "runs": runs,
    }
    path = write_json(out / "recovery.json", report)
    print()
    print(table(summaries))
    print()
    for c in summaries:
        if c["skipped"]:
            print(f"skipped {c['key']}: {c['skipped']}")
        for error in c["errors"]:
            print(f"failed run of {c['key']}: {error[:300]}")
        if c["identical_to_fault_free"] is False:
            print(f"{c['key']}: final parameters differ from the fault-free run")
    for c in summaries:
        print(f"{c['key']}: 1-min load average before its runs (median) {c['loadavg1_median']}")
    for t in targets:
        value = t["kill_to_first_step_s"]
        print(f"{t['verdict']}  {t['target']} ({t['cell']}): kill→first step "
              f"{'failed' if value is None else f'{value:.3f} s'}")
    if not targets:
        print("(no cell of this run has a target)")
    progress(f"wrote {path}" + (f" and {png}" if drawn else ""))
    return 130 if interrupted else 0


def _on_sigterm(signum: int, frame: object) -> None:
    for proc in list(_CHILDREN):  # stop the launch in flight; it stops what it started
        try:
            _stop(proc)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
