#!/usr/bin/env python
"""phalanx vs torchrun + DCP checkpoints vs torchft: the same jobs, the same fault, side by side.

For each job (``mlp``: ``examples/train_mlp.py`` as the demo runs it, a 50 ms step;
``transformer``: ``examples/train_transformer.py``, a small language model whose state
with Adam is ~270 MiB per rank) and each repeat, this runs:

* ``torchrun``: ``torch.distributed.run`` (elastic agent, c10d rendezvous, gloo,
  ``--max-restarts 3``) running ``bench/torchrun_train.py`` without checkpoints and without
  a fault: the reference parameters and the step time every overhead is measured against;
* ``dcp k=K`` / ``dcp async k=K`` for each K of ``--ks``: the same with
  ``torch.distributed.checkpoint`` ``save`` / ``async_save`` every K steps to local disk,
  resuming from the newest complete checkpoint after the restart;
* ``torchft``: torchft 0.2.0 (``bench/vs_torchft.py``): its Lighthouse, one replica group
  per rank on its gloo process group, its DistributedDataParallel, Manager and
  OptimizerWrapper; ``bench/torchft_run.py`` restarts the killed group, which heals from
  the live one (``make bench-deps`` installs it; a missing torchft is a failed run);
* ``phalanx``: ``phalanx launch`` with default settings (whatever ``snapshot`` defaults the
  installed phalanx has) and one warm spare, 2 virtual nodes.

The fault is the same everywhere: the bench itself SIGKILLs rank 1's process once that rank
has completed step ``--fault-step`` (it watches each rank's per-step progress file). It
measures, per run: total wall time; start-up (launch -> first step done by every rank),
the warm-up step time (steps 1 .. 20% of the run), the steady-state step time (rank 0's
mean step after the warm-up up to the fault, a multiple of 50 steps so periodic saves
count) and the capture-window step time (the last 50 steps before the fault), each
overhead vs ``torchrun`` without checkpoints (``bench/vs_torchrun_steps.py``); kill →
first step completed by every rank after recovery; lost steps (the steps the ranks had
completed at the kill minus the step training resumed from); bytes written to storage (DCP
folders; phalanx's disk-tier writes); peak host memory (private memory of every process of
the run plus the growth of /dev/shm, sampled every 0.2 s); the final parameter hash vs the
fault-free ``torchrun`` run (the same arithmetic: phalanx's all-reduce is the same gloo
all-reduce; torchft's fault-free run matches it too); torchft's degraded steps (committed
without the killed group); goodput, the run's wall time broken down into
start-up, productive steps, redone steps, recovery phases, save or snapshot stalls and
shutdown (``bench/vs_torchrun_goodput.py``). Medians over the repeats.

Scaling: kill → first step and lost steps vs world size (``--worlds``) for ``dcp k=10``
and ``phalanx`` on the MLP job.

Writes ``<out>/vs_torchrun.json``, ``vs_torchrun.md`` (tables, ratios phalanx/torchrun,
targets) and ``vs_torchrun.png`` (recovery time, lost steps, overhead; recovery vs world
size). ``--quick``: the MLP only, K=10, world 2, one repeat, 32 steps (a schema test);
``--systems`` picks some systems (the fault-free ``torchrun`` reference always runs).
A failed run is recorded with its output tail and the bench goes on; a missed target never
fails the process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info, progress, write_json  # noqa: E402
from bench.recovery import HASH_RE, launch, med, phases_of, read_events, tail  # noqa: E402
from bench.run_watch import (Supervised, Killer, MemorySampler, Tail, du, free_port,  # noqa: E402
                             json_lines, process_tree)
from bench.vs_torchrun_report import (SCALING_SYSTEMS, markdown, ms, plot,  # noqa: E402
                                      ratios_of, scaling_of, summarize, targets_of)
from bench.vs_torchrun_goodput import phalanx_goodput, torchrun_goodput  # noqa: E402
from bench.vs_torchrun_steps import (WARMUP_SHARE, capture_window, regained,  # noqa: E402
                                     steady_window, step_figures, warmup_end)
from bench.vs_torchft import SETTINGS as TORCHFT_SETTINGS  # noqa: E402
from bench.vs_torchft import differs_because, run_torchft  # noqa: E402

SCHEMA_VERSION = 2
TARGET_RANK = 1
SCALING_STEPS = (30, 24)   # steps, fault step of the scaling runs (only recovery counts)
JOBS: dict[str, dict[str, Any]] = {
    # the demo's MLP: sleep_per_step_s stands for 50 ms of compute per step
    # steps / fault_step: long enough that the steady state (steps 74 .. 173, after a
    # warm-up of 40) is measured apart from start-up; torchrun loses K/2 steps at the kill
    # for K = 10 and 50 alike (the mean over random fault times: 4 and 24), and 26 steps
    # follow the fault
    "mlp": {"entrypoint": "examples/train_mlp.py:main", "steps": 200, "fault_step": 174,
            "args": {"batch_size": 32, "hidden": 64, "lr": 0.05, "seed": 0,
                     "sleep_per_step_s": 0.05}},
    "transformer": {"entrypoint": "examples/train_transformer.py:main", "steps": 200,
                    "fault_step": 174,
                    "args": {"batch_size": 2, "lr": 0.001, "seed": 0}},
}


@dataclass(frozen=True)
class System:
    key: str          # "torchrun", "dcp_k10", "dcp_async_k10", "torchft", "phalanx"
    label: str
    every: int = 0    # DCP save interval; 0 = none
    async_save: bool = False
    faulted: bool = True

    @property
    def is_phalanx(self) -> bool:
        return self.key == "phalanx"

    @property
    def is_torchft(self) -> bool:
        return self.key == "torchft"


def systems_for(ks: Sequence[int]) -> list[System]:
    found = [System("torchrun", "torchrun, no checkpoints (no fault)", faulted=False)]
    for k in ks:
        found.append(System(f"dcp_k{k}", f"torchrun + DCP save k={k}", every=k))
    for k in ks:
        found.append(System(f"dcp_async_k{k}", f"torchrun + DCP async_save k={k}", every=k,
                            async_save=True))
    return found + [System("torchft", "torchft 0.2.0 (Lighthouse, heal from live peer)"),
                    System("phalanx", "phalanx (defaults, 1 warm spare)")]


@dataclass
class Run:
    system: System
    job: str
    world: int
    steps: int
    fault_step: int
    repeat: int
    purpose: str = "main"     # main | scaling
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> int:
        return TARGET_RANK

    @property
    def name(self) -> str:
        return f"{self.job}-{self.system.key}-w{self.world}-{self.purpose}{self.repeat}"


# -- torchrun ------------------------------------------------------------------------------
def run_torchrun(run: Run, work: Path, timeout_s: float) -> dict[str, Any]:
    system, root = run.system, work / run.name
    ckpt, prog = root / "checkpoints", root / "progress"
    root.mkdir(parents=True)
    job_args = {**JOBS[run.job]["args"], "steps": run.steps}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc-per-node", str(run.world), "--max-restarts", "3",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "--rdzv-id", run.name, str(ROOT / "bench" / "torchrun_train.py"),
           "--job", run.job, "--job-args", json.dumps(job_args), "--ckpt-dir", str(ckpt),
           "--every", str(system.every), "--progress", str(prog)]
    if system.async_save:
        cmd.append("--async-save")

    watch = Supervised(prog, run.world)
    started = time.time()
    log_path = root / "torchrun.log"
    watch.run(cmd, root, log_path, timeout_s, _stop_torchrun,
              run.fault_step if system.faulted else None, TARGET_RANK)
    code, peak, killer = watch.code, watch.peak, watch.killer
    wall = time.time() - started
    records = {r: json_lines(prog / f"rank{r}.jsonl") for r in range(run.world)}
    out: dict[str, Any] = {"returncode": code, "wall_s": round(wall, 3),
                           "peak_host_memory_bytes": peak, "processes": watch.processes,
                           "peak_memory_parts": watch.parts,
                           "bytes_written": du(ckpt), "checkpoints": _checkpoints(ckpt)}
    rank0 = records[0]
    out.update(step_figures(   # the same windows in every run, faulted or not
        [(r["step"], r["t"]) for r in rank0 if r["event"] == "step" and r["attempt"] == 0],
        [min((r["t"] for r in rs if r["event"] == "step" and r["attempt"] == 0), default=None)
         for rs in records.values()], started, run.steps, run.fault_step))
    saves = [r["seconds"] for r in rank0 if r["event"] == "saved"]
    out["save_blocking_s"] = med(saves)
    done = [r for rs in records.values() for r in rs if r["event"] == "done"]
    hashes = {r["hash"] for r in done}
    out.update({"hash": done[0]["hash"] if len(hashes) == 1 and len(done) == run.world else None,
                "ranks_agree": len(hashes) == 1 and len(done) == run.world,
                "steps_completed": min((r["step"] for r in done), default=0),
                "attempts": 1 + max((r["attempt"] for rs in records.values() for r in rs),
                                    default=0)})
    errors = []
    if code is None:
        errors.append(f"timed out after {timeout_s:.0f} s (stopped with SIGTERM)")
    elif code != 0:
        errors.append(f"torchrun exited {code}")
    if killer is not None:
        errors += _torchrun_recovery(out, killer, records)
    out["goodput"] = torchrun_goodput(records, started, started + wall, out, run.steps)
    if out["steps_completed"] != run.steps or not out["ranks_agree"]:
        errors.append(f"{len(done)} of {run.world} ranks finished, at step "
                      f"{out['steps_completed']} of {run.steps}")
    out["ok"] = not errors
    if errors:
        out["error"] = "; ".join(errors)
        out["output_tail"] = tail(log_path.read_text(encoding="utf-8", errors="replace"))
    return out


def _checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []


def _torchrun_recovery(out: dict[str, Any], killer: Killer,
                       records: dict[int, list[dict[str, Any]]]) -> list[str]:
    if killer.killed_at is None:
        return ["the fault never fired (rank 1 did not reach the fault step)"]
    kill = killer.killed_at
    after = {r: [x for x in rs if x["attempt"] >= 1] for r, rs in records.items()}
    if not all(any(x["event"] == "step" for x in rs) for rs in after.values()):
        return ["no step completed by every rank after the restart"]

    def first(rank: int, event: str) -> dict[str, Any]:
        return next(x for x in after[rank] if x["event"] == event)
    starts = [first(r, "start") for r in after]
    resumed = [first(r, "resumed") for r in after]
    first_step = max(first(r, "step")["t"] for r in after)
    spawned = min(s["t"] - s["since_exec_s"] for s in starts)
    imported = max(s["t"] for s in starts)
    loaded = max(s["t"] for s in resumed)
    resume_step = int(resumed[0]["step"])
    out.update({"killed_at": kill, "killed_pid": killer.pid,
                "reached_step": killer.reached, "resume_step": resume_step,
                "kill_to_first_step_s": round(first_step - kill, 4),
                "lost_steps": killer.reached - resume_step if killer.reached else None,
                "load_s": max(s["seconds"] for s in resumed),
                "kill_to_regained_s": regained(
                    {r: [(x["step"], x["t"]) for x in rs if x["event"] == "step"]
                     for r, rs in after.items()}, kill, killer.reached),
                "phases": {"restart": round(spawned - kill, 4),
                           "import": round(imported - spawned, 4),
                           "init_and_load": round(loaded - imported, 4),
                           "first_step": round(first_step - loaded, 4)}})
    return []


def _stop_torchrun(proc: subprocess.Popen) -> None:
    """SIGTERM to the agent (it stops its workers), then SIGKILL every process left."""
    members = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for pid in members | process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


# -- phalanx -------------------------------------------------------------------------------
def phalanx_config(run: Run, root: Path, timeout_s: float) -> Path:
    """Defaults everywhere but the job, 2 virtual nodes and room for ``world`` ranks."""
    job_args = {**JOBS[run.job]["args"], "steps": run.steps, "step_log": str(root / "steps")}
    text = "\n".join([
        "job:",
        f"  name: vs-{run.job}-{run.repeat}",
        f"  entrypoint: {ROOT / JOBS[run.job]['entrypoint']}",
        f"  world_size: {run.world}",
        "  nodes: 2",
        f"  run_dir: {root / 'runs'}",
        f"  timeout_s: {timeout_s:g}",
        f"  args: {json.dumps(job_args)}",
        "ray:",
        "  virtual_nodes: 2",
        f"  cpus_per_node: {cpus_per_node(run.world)}",
        "spares:",
        "  count: 1", ""])
    path = root / "phalanx.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def cpus_per_node(world: int) -> float:
    """Ray's logical CPUs per virtual node: the default 2, or just enough for ``world``
    workers and the spare at ``job.cpus_per_worker`` 0.5 each. More than needed costs
    steady-state time: Ray starts idle worker processes up to its CPU count."""
    return max(2.0, math.ceil((world + 1) * 0.5 / 2))


def run_phalanx(run: Run, work: Path, timeout_s: float) -> dict[str, Any]:
    root = work / run.name
    root.mkdir(parents=True)
    config = phalanx_config(run, root, timeout_s)
    live = root / "steps"

    tails = {r: Tail(Path(f"{live}.rank{r}.live")) for r in range(run.world)}

    def latest(rank: int) -> tuple[int, int | None]:
        records = tails[rank].read()
        return (records[-1]["step"], records[-1]["pid"]) if records else (-1, None)

    watchers: dict[str, Any] = {}

    def on_start(proc: subprocess.Popen) -> None:
        watchers["sampler"] = MemorySampler(proc.pid)
        watchers["sampler"].start()
        watchers["killer"] = Killer(latest, run.world, run.fault_step, TARGET_RANK)
        watchers["killer"].start()

    started = time.time()
    code, stdout, stderr, _ = launch([], timeout_s + 90, config=config, on_start=on_start)
    wall = time.time() - started
    killer: Killer = watchers["killer"]
    killer.stop()
    sampler: MemorySampler = watchers["sampler"]
    peak = sampler.stop()
    run_dir, events = read_events(root / "runs")
    hashes = {int(r): h for r, h in HASH_RE.findall(stdout)}
    steps = {r: [(x["step"], x["t"]) for x in json_lines(Path(f"{live}.rank{r}.live"))]
             for r in range(run.world)}
    rank0 = json_lines(Path(f"{live}.rank0.live"))
    out: dict[str, Any] = {
        "returncode": code, "wall_s": round(wall, 3), "peak_host_memory_bytes": peak,
        "processes": sampler.processes, "peak_memory_parts": sampler.parts,
        "bytes_written": sum(int(e.get("bytes", 0)) for e in events
                             if e.get("event") == "tier_persisted"),
        **step_figures(steps[0], [found[0][1] if found else None for found in steps.values()],
                       started, run.steps, run.fault_step),
        "hash": hashes.get(0) if len(set(hashes.values())) == 1 else None,
        "ranks_agree": len(hashes) == run.world and len(set(hashes.values())) == 1,
        "steps_completed": max((r["step"] + 1 for r in rank0), default=0),
        "run_dir": str(run_dir) if run_dir else None,
        "snapshot_config": snapshot_config(run_dir)}
    errors = []
    if code is None:
        errors.append(f"timed out after {timeout_s + 90:.0f} s (stopped with SIGTERM)")
    elif code != 0:
        errors.append(f"phalanx launch exited {code}")
    if not out["ranks_agree"]:
        errors.append(f"{len(hashes)} of {run.world} ranks printed one final hash")
    errors += _phalanx_recovery(out, killer, events, steps)
    out["goodput"] = phalanx_goodput(out["run_dir"], started, started + wall,
                                     (out.get("phases") or {}).get("notice"))
    if out["goodput"] is None:
        errors.append("the run wrote no summary.json (no goodput)")
    out["ok"] = not errors
    if errors:
        out["error"] = "; ".join(errors)
        out["output_tail"] = tail(stderr) + "\n--- stdout ---\n" + tail(stdout, 800)
    return out


def snapshot_config(run_dir: Path | None) -> dict[str, Any] | None:
    """The ``snapshot`` section of the config the run used (its run directory's
    config.yaml, defaults filled in), or None: the report says which settings it measured."""
    try:
        text = (run_dir / "config.yaml").read_text(encoding="utf-8") if run_dir else ""
        section = yaml.safe_load(text).get("snapshot") if text else None
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return section if isinstance(section, dict) else None


def _phalanx_recovery(out: dict[str, Any], killer: Killer, events: list[dict[str, Any]],
                      steps: dict[int, list[tuple[int, float]]]) -> list[str]:
    if killer.killed_at is None:
        return ["the fault never fired (rank 1 did not reach the fault step)"]
    kill = killer.killed_at
    recovered = [e for e in events if e.get("event") == "recovered"
                 and float(e.get("first_step_at", 0)) > kill]
    if not recovered:
        return ["no recovered event after the kill"]
    record = recovered[0]
    kill_to_first = float(record["first_step_at"]) - kill
    resume_step = int(record["restore_step"])
    out.update({"killed_at": kill, "killed_pid": killer.pid, "reached_step": killer.reached,
                "resume_step": resume_step, "kill_to_first_step_s": round(kill_to_first, 4),
                "lost_steps": killer.reached - resume_step if killer.reached else None,
                "phalanx_lost_steps": record.get("lost_steps"),
                "kill_to_regained_s": regained(steps, kill, killer.reached),
                "recoveries": sum(1 for e in events if e.get("event") == "recovered"),
                "detected_as": record.get("fault"),
                "phases": phases_of(record, kill_to_first)})
    return []


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="mlp only, K=10, world 2, 1 repeat, 40 steps (under 3 minutes)")
    p.add_argument("--jobs", default="mlp,transformer")
    p.add_argument("--ks", default="10,50", help="DCP save intervals")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each mlp cell")
    p.add_argument("--transformer-repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=None,
                   help="steps of every job (default 200: the first 20%% are warm-up, the "
                   "steady state is measured after them)")
    p.add_argument("--fault-step", type=int, default=None,
                   help="rank 1 is killed once it completed this step (default 174)")
    p.add_argument("--systems", default="",
                   help="comma-separated systems to run (torchrun, dcp_kK, dcp_async_kK, "
                   "torchft, phalanx; default all); the torchrun reference always runs")
    p.add_argument("--worlds", default="2,4,8", help="world sizes of the scaling runs")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's folder")
    args = p.parse_args(argv)
    if args.quick:
        args.jobs, args.ks, args.repeats, args.worlds = "mlp", "10", 1, "2"
        args.steps, args.fault_step, args.transformer_repeats = 32, 24, 1
    args.job_list = [j for j in args.jobs.split(",") if j]
    unknown = [j for j in args.job_list if j not in JOBS]
    if unknown:
        p.error(f"--jobs: unknown {unknown}; expected some of {sorted(JOBS)}")
    args.k_list = [int(k) for k in args.ks.split(",") if k]
    known = [s.key for s in systems_for(args.k_list)]
    args.system_list = [s for s in args.systems.split(",") if s] or known
    if "torchrun" not in args.system_list:
        args.system_list.insert(0, "torchrun")
    if set(args.system_list) - set(known):
        p.error(f"--systems: unknown {sorted(set(args.system_list) - set(known))}; "
                f"expected some of {known}")
    args.world_list = [int(w) for w in args.worlds.split(",") if w]
    for job in args.job_list:
        steps, fault = steps_of(args, job)
        if not 0 < fault < steps:
            p.error(f"{job}: the fault step {fault} must lie inside 1 .. steps - 1 ({steps})")
    return args


def steps_of(args: argparse.Namespace, job: str) -> tuple[int, int]:
    """(steps, fault step) of ``job``: the command line's, else the job's defaults."""
    return (args.steps or JOBS[job]["steps"]), (args.fault_step or JOBS[job]["fault_step"])


def plan(args: argparse.Namespace) -> list[Run]:
    runs = []
    for job in args.job_list:
        repeats = args.repeats if job == "mlp" else args.transformer_repeats
        for repeat in range(repeats):   # interleaved: load drifts hit every system alike
            for system in chosen(args):
                runs.append(Run(system, job, 2, *steps_of(args, job), repeat))
    if "mlp" in args.job_list:
        scaling = [s for s in chosen(args) if s.key in SCALING_SYSTEMS]
        for world in args.world_list:
            if world == 2:
                continue   # the main runs are world 2
            for system in scaling:
                runs.append(Run(system, "mlp", world, *SCALING_STEPS, 0, purpose="scaling"))
    return runs


def chosen(args: argparse.Namespace) -> list[System]:
    return [s for s in systems_for(args.k_list) if s.key in args.system_list]


def state_mib(job: str) -> float | None:
    """Parameters + optimizer state of one rank, MiB (built once, not trained)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        if job == "transformer":
            import train_transformer as lm
            model = lm.make_model(JOBS[job]["args"]["seed"])
            return round(lm.state_bytes(model, lm.make_optimizer(model, 1e-3)) / 2**20, 1)
        import train_mlp
        model = train_mlp.make_model(JOBS[job]["args"]["hidden"], JOBS[job]["args"]["seed"])
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return round(2 * params / 2**20, 3)      # + SGD momentum
    except Exception as exc:   # a note, not a failure: the runs measure what matters
        progress(f"could not size the {job} state: {exc!r}")
        return None


def execute(run: Run, work: Path, timeout_s: float) -> dict[str, Any]:
    """One run's result; a run that raised is a failed run, not a failed bench."""
    try:
        if run.system.is_torchft:
            result = run_torchft(run, work, timeout_s, JOBS[run.job]["args"])
        elif run.system.is_phalanx:
            result = run_phalanx(run, work, timeout_s)
        else:
            result = run_torchrun(run, work, timeout_s)
    except Exception as exc:
        result = {"ok": False, "error": f"the bench failed on this run: {exc!r}"}
    return {"name": run.name, "system": run.system.key, "job": run.job, "world": run.world,
            "repeat": run.repeat, "purpose": run.purpose, "steps": run.steps,
            "fault_step": run.fault_step if run.system.faulted else None, **result}


def job_meta(args: argparse.Namespace, job: str) -> dict[str, Any]:
    steps, fault = steps_of(args, job)
    return {**JOBS[job], "world": 2, "state_mib": state_mib(job), "steps": steps,
            "fault_step": fault, "warmup_end": warmup_end(steps, fault),
            "steady_window": list(steady_window(steps, fault)),
            "capture_window": list(capture_window(fault))}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vs-torchrun-"))
    runs = plan(args)
    started = time.time()
    progress(f"{len(runs)} runs: jobs {args.job_list}, K {args.k_list}, worlds "
             f"{args.world_list}, work dir {work}")
    try:
        for i, run in enumerate(runs, 1):
            run.result = r = execute(run, work, args.run_timeout)
            progress(f"[{i}/{len(runs)}] {run.name}: "
                     + (f"wall {r['wall_s']:.1f} s, step {ms(r.get('steady_step_s'))} ms, "
                        f"kill→first step {r.get('kill_to_first_step_s')} s, lost "
                        f"{r.get('lost_steps')}" if r["ok"] else f"FAILED: {r.get('error')}"))
            if not args.keep_runs:
                shutil.rmtree(work / run.name, ignore_errors=True)
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    results = [run.result for run in runs]
    # the reference: the first fault-free torchrun run without checkpoints of each job
    references = {}
    for r in results:
        if r["system"] == "torchrun" and r["ok"] and r["world"] == 2:
            references.setdefault(r["job"], r["hash"])
    for r in results:
        ref = references.get(r["job"]) if r["world"] == 2 else None
        r["identical_to_fault_free"] = r.get("hash") == ref if ref and r.get("hash") else None
        if r["system"] == "torchft":
            r["differs_because"] = differs_because(r)
    summary = summarize(results, {s.key: s.label for s in chosen(args)}, references)
    report: dict[str, Any] = {
        "bench": "vs_torchrun", "schema_version": SCHEMA_VERSION, "quick": args.quick,
        "machine": machine_info(), "started": started, "seconds": round(time.time() - started, 1),
        "target_rank": TARGET_RANK, "warmup_share": WARMUP_SHARE, "ks": args.k_list,
        "systems": args.system_list, "torchft": TORCHFT_SETTINGS, "repeats": args.repeats,
        "transformer_repeats": args.transformer_repeats, "worlds": args.world_list,
        "jobs": {job: job_meta(args, job) for job in args.job_list},
        "references": references, "runs": results, "summary": summary,
        "ratios": ratios_of(summary), "targets": targets_of(summary),
        "scaling": scaling_of(results)}
    png = out / "vs_torchrun.png"
    report["png"] = str(png) if plot(png, report) else None
    text = markdown(report)
    (out / "vs_torchrun.md").write_text(text, encoding="utf-8")
    write_json(out / "vs_torchrun.json", report)
    print(text)
    progress(f"wrote {out / 'vs_torchrun.json'}, vs_torchrun.md"
             + (", vs_torchrun.png" if report["png"] else "")
             + f" in {report['seconds']:.0f} s")
    return 0


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt   # unwinds: the finally blocks stop what was started


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.exit(main())
