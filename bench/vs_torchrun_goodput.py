"""Goodput of each ``bench/vs_torchrun.py`` run over the bench's own wall window (the
process started -> it exited), in ``phalanx.launcher.goodput``'s breakdown: phalanx runs
from the run's ``summary.json`` (its launcher's window, widened by the process start-up
before it and the teardown after it); torchrun runs from their per-rank progress records
(start-up to the first step of every rank, the restart's phases, DCP saves as the snapshot
stall, the lost steps redone, the exit after the last step); torchft runs likewise, with
their own recovery phases."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from phalanx.launcher.goodput import Goodput, Window, account


def phalanx_goodput(run_dir: str | None, started: float, ended: float,
                    notice_s: float | None = None) -> dict[str, Any] | None:
    """The run's summary.json goodput widened to [started, ended] (wall clock), or None
    when the run wrote no summary. ``notice_s``: kill -> the launcher observing it, which
    the launcher cannot tell from training but torchrun's ``restart`` phase includes: moved
    from productive to a ``notice`` recovery phase, so both systems count it alike."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text()) if run_dir else None
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not isinstance(summary.get("goodput"), dict):
        return None
    goodput = Goodput.from_json(summary["goodput"])
    if notice_s and notice_s > 0:
        moved = min(notice_s, goodput.productive_s)
        goodput = replace(goodput, productive_s=goodput.productive_s - moved,
                          recovery_s={"notice": moved, **goodput.recovery_s})
    before = float(summary.get("started_at", started)) - started
    after = ended - float(summary.get("ended_at", ended))
    return {**goodput.widened(before, after).to_json(),
            "window": "bench wall: launcher summary widened by process start and teardown"}


def torchrun_goodput(records: Mapping[int, Sequence[Mapping[str, Any]]], started: float,
                     ended: float, result: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The breakdown of a torchrun run from its ranks' progress records (``step`` records
    with ``t`` the step's end, ``saved`` with the blocking seconds) and what
    ``_torchrun_recovery`` measured into ``result`` (kill time, phases, lost steps)."""
    firsts = [min((r["t"] for r in rs if r["event"] == "step" and r["attempt"] == 0),
                  default=None) for rs in records.values()]
    lasts = [max((r["t"] for r in rs if r["event"] == "step"), default=None)
             for rs in records.values()]
    first_step = max(firsts) if firsts and None not in firsts else ended
    last_step = max(lasts) if lasts and None not in lasts else ended
    windows = [Window("startup", started, first_step), Window("shutdown", last_step, ended)]
    recovered = isinstance(result.get("killed_at"), (int, float)) and result.get("phases")
    if recovered:
        at = float(result["killed_at"])
        for phase, value in result["phases"].items():   # in order (torchft has its own)
            seconds = float(value or 0.0)
            windows.append(Window("recovery", at, at + seconds, phase))
            at += seconds
    rank0 = records.get(0, [])
    stall = sum(float(r["seconds"]) for r in rank0 if r["event"] == "saved")
    lost = int(result.get("lost_steps") or 0)
    goodput = account(started, ended, windows,
                      steps_computed=max(0, steps - 1 + lost - (1 if recovered else 0)),
                      lost_steps=lost, snapshot_stall_s=stall, recoveries=1 if recovered else 0)
    return {**goodput.to_json(), "window": "bench wall: torchrun started -> exited"}
