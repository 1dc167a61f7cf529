"""torchft 0.2.0 as a peer in ``bench/vs_torchrun.py``: one run of ``bench/torchft_run.py``
(its Lighthouse plus one ``bench/torchft_train.py`` process per replica group, world 2 = two
replica groups of one rank), rank 1's process SIGKILLed at the fault step like every other
system's, restarted by the supervisor and healed by torchft from the live group.

torchft does not roll back: the survivor keeps committing steps (alone, once the Lighthouse
dropped the dead group) while the killed group restarts, and the restarted group joins at the
survivor's step. So ``lost_steps`` (steps recomputed) is 0, and ``degraded_steps`` counts what
that costs instead: steps committed without the killed group's batches (its share of the
data for those steps is never trained), which is why the final parameters then differ from
the fault-free run's.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.recovery import tail
from bench.run_watch import Supervised, json_lines, process_tree
from bench.torchft_run import LIGHTHOUSE_FLAGS, TorchftMissing, lighthouse_binary
from bench.vs_torchrun_goodput import torchrun_goodput
from bench.vs_torchrun_steps import regained, step_figures

ROOT = Path(__file__).resolve().parent.parent
MAX_RESTARTS = 3
SETTINGS = {"version": "0.2.0", "lighthouse": " ".join(LIGHTHOUSE_FLAGS),
            "heartbeat_timeout_ms": 5000, "min_replica_size": 1, "use_async_quorum": True,
            "checkpoint_transport": "HTTPTransport", "init_sync": False,
            "process_group": "torchft ProcessGroupGloo", "max_restarts": MAX_RESTARTS}


def torchft_missing() -> str | None:
    """Why torchft cannot run here (not importable, no Lighthouse binary), or None."""
    if importlib.util.find_spec("torchft") is None:
        return ("torchft is not installed in " + sys.executable + ": run `make bench-deps` "
                "(pip install -c constraints.txt -e '.[bench]')")
    try:
        lighthouse_binary()
    except TorchftMissing as exc:
        return str(exc)
    return None


def run_torchft(run: Any, work: Path, timeout_s: float,
                job_args: Mapping[str, Any]) -> dict[str, Any]:
    """One faulted torchft run of ``run`` (a ``bench.vs_torchrun.Run``): the same result
    fields as a torchrun run, plus ``degraded_steps`` and ``survivor_stall_s``. A torchft
    that is missing is a failed run with the reason."""
    missing = torchft_missing()
    if missing is not None:
        return {"ok": False, "error": missing, "returncode": None}
    root, prog = work / run.name, work / run.name / "progress"
    root.mkdir(parents=True)
    cmd = [sys.executable, str(ROOT / "bench" / "torchft_run.py"), "--replicas", str(run.world),
           "--max-restarts", str(MAX_RESTARTS), "--", "--job", run.job, "--job-args",
           json.dumps({**job_args, "steps": run.steps}), "--progress", str(prog)]
    watch = Supervised(prog, run.world)
    started = time.time()
    log_path = root / "torchft.log"
    watch.run(cmd, root, log_path, timeout_s, _stop, run.fault_step, run.target)
    code, peak, killer = watch.code, watch.peak, watch.killer
    assert killer is not None
    wall = time.time() - started
    records = {r: json_lines(prog / f"rank{r}.jsonl") for r in range(run.world)}
    out = _measure(records, run, started, wall)
    out.update({"returncode": code, "peak_host_memory_bytes": peak,
                "processes": watch.processes, "peak_memory_parts": watch.parts})
    errors = []
    if code is None:
        errors.append(f"timed out after {timeout_s:.0f} s (stopped with SIGTERM)")
    elif code != 0:
        errors.append(f"bench/torchft_run.py exited {code}")
    if killer.killed_at is None:
        errors.append("the fault never fired (rank 1 did not reach the fault step)")
    else:
        found, why = torchft_recovery(records, killer.killed_at, killer.reached, run.target,
                                      run.world)
        out.update({"killed_at": killer.killed_at, "killed_pid": killer.pid,
                    "reached_step": killer.reached, **found})
        errors += why
    out["goodput"] = torchrun_goodput(records, started, started + wall, out, run.steps)
    if out["steps_completed"] != run.steps or not out["ranks_agree"]:
        errors.append(f"{len(_done(records))} of {run.world} replica groups finished, at "
                      f"step {out['steps_completed']} of {run.steps}")
    out["ok"] = not errors
    if errors:
        out["error"] = "; ".join(errors)
        out["output_tail"] = tail(log_path.read_text(encoding="utf-8", errors="replace"))
    return out


def _done(records: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """The last ``done`` record of each rank that wrote one."""
    found = []
    for rs in records.values():
        done = [r for r in rs if r["event"] == "done"]
        if done:
            found.append(done[-1])
    return found


def _measure(records: Mapping[int, Sequence[Mapping[str, Any]]], run: Any, started: float,
             wall: float) -> dict[str, Any]:
    done = _done(records)
    hashes = {r["hash"] for r in done}
    agree = len(hashes) == 1 and len(done) == run.world
    firsts = [min((r["t"] for r in rs if r["event"] == "step" and r["attempt"] == 0),
                  default=None) for rs in records.values()]
    ends = [(r["step"], r["t"]) for r in records.get(0, []) if r["event"] == "step"]
    return {"wall_s": round(wall, 3), "bytes_written": 0,   # torchft writes no checkpoint
            **step_figures(ends, firsts, started, run.steps, run.fault_step),
            "hash": done[0]["hash"] if agree else None, "ranks_agree": agree,
            "steps_completed": min((r["step"] for r in done), default=0),
            "attempts": 1 + max((r["attempt"] for rs in records.values() for r in rs),
                                default=0)}


def torchft_recovery(records: Mapping[int, Sequence[Mapping[str, Any]]], kill: float,
                     reached: int | None, target: int,
                     world: int) -> tuple[dict[str, Any], list[str]]:
    """(the recovery figures, errors) of a torchft run from its groups' progress records:
    kill -> every group's first step after it, kill -> every group back at the step
    reached, the phases of the restarted group, steps lost (recomputed; torchft does not
    roll back) and degraded (committed by survivors without the killed group)."""
    restarted = [x for x in records.get(target, []) if x["attempt"] >= 1]
    start = next((x for x in restarted if x["event"] == "start"), None)
    if start is None:
        return {}, [f"replica group {target} was never restarted after the kill"]
    steps = {r: [(x["step"], x["t"]) for x in (restarted if r == target else rs)
                 if x["event"] == "step" and x["t"] > kill] for r, rs in records.items()}
    if not all(steps.values()):
        return {}, ["no step completed by every replica group after the restart"]
    first_step = max(found[0][1] for found in steps.values())
    joined = next((x for x in restarted if x["event"] == "joined"), start)
    healed = next((x for x in restarted if x["event"] == "healed"), joined)
    spawned = start["t"] - start["since_exec_s"]
    resume_step = steps[target][0][0]
    survivors = [r for r in records if r != target]
    degraded = max((sum(1 for x in records[r] if x["event"] == "step" and x["t"] > kill
                        and x.get("n", world) < world) for r in survivors), default=0)
    stall = min((steps[r][0][1] for r in survivors), default=first_step) - kill
    return {"resume_step": resume_step,
            "kill_to_first_step_s": round(first_step - kill, 4),
            "lost_steps": max(0, reached - resume_step) if reached else None,
            "degraded_steps": degraded, "survivor_stall_s": round(stall, 4),
            "healed": any(x["event"] == "healed" for x in restarted),
            "kill_to_regained_s": regained(steps, kill, reached),
            "phases": {"restart": round(spawned - kill, 4),
                       "import": round(start["t"] - spawned, 4),
                       "init": round(joined["t"] - start["t"], 4),
                       "heal": round(healed["t"] - joined["t"], 4),
                       "first_step": round(first_step - healed["t"], 4)}}, []


def differs_because(result: Mapping[str, Any]) -> str | None:
    """One line on why a torchft run's final parameters differ from the fault-free run's
    (None when they do not, or when that is unknown)."""
    if result.get("identical_to_fault_free") is not False:
        return None
    degraded = result.get("degraded_steps")
    if degraded:
        return (f"the survivor committed {degraded} step(s) without the killed group's "
                "batches (torchft keeps training with the replicas it has and redoes no "
                "step), so those steps averaged one group's gradient instead of two")
    return "unexplained: no step was degraded (see the run's torchft.log)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the supervisor (it stops the Lighthouse and the groups), then SIGKILL
    every process of the run left."""
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
