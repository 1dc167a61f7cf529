"""Step-time figures of one ``bench/vs_torchrun.py`` run, the start-up cost kept apart from
the steady state (pure functions over (step, epoch end) pairs):

    launch        step 0      warm-up end                       fault step
      |-----------|-----------|--------------------------------------|
       start-up    warm-up     steady state (a multiple of 50 or 10 steps)
                                             |-- capture window ------|
                                                (the last 50 steps)

* ``startup_s``: launch -> the first step done by every rank (interpreters, process groups,
  model builds; for phalanx also keepers, spares, the first snapshot slots);
* ``warmup_step_s``: the mean step over steps 1 .. warm-up end (first captures, pre-faulting
  and first pushes land here on short runs);
* ``steady_step_s``: the mean step after the warm-up, up to the fault; its length is a
  multiple of every DCP save interval K (50 where it fits, else 10) so each K's saves count;
* ``window_step_s``: the mean over the last 50 steps before the fault, the figure the bench
  reported before start-up and steady state were told apart (a capture window: one save per
  K, phalanx's snapshots and pushes).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from bench.run_watch import steady_step_s as mean_step_s   # mean over a window of steps

WARMUP_SHARE = 0.2          # the first 20% of a run's steps are warm-up
MIN_WARMUP = 3
CAPTURE_WINDOW = 50
SAVE_UNITS = (50, 10)       # the DCP save intervals the steady window is a multiple of


def warmup_end(steps: int, fault_step: int) -> int:
    """The first step of the steady state: past the first 20% of the run (3 at least), and
    before the fault step."""
    return max(1, min(max(MIN_WARMUP, math.ceil(steps * WARMUP_SHARE)), fault_step - 1))


def steady_window(steps: int, fault_step: int) -> tuple[int, int]:
    """Steps ``first .. end - 1`` of the steady state: after the warm-up, ending at the
    fault step, as long as fits and a multiple of 50 (else 10) steps when one fits."""
    span = fault_step - warmup_end(steps, fault_step)
    for unit in SAVE_UNITS:
        if span >= unit:
            span -= span % unit
            break
    return fault_step - span, fault_step


def capture_window(fault_step: int) -> tuple[int, int]:
    """The last 50 steps before the fault step, past the first 3 (allocation)."""
    return max(MIN_WARMUP, fault_step - CAPTURE_WINDOW), fault_step


def startup_s(first_ends: Sequence[float | None], started: float) -> float | None:
    """Launch -> the first step done by every rank (``first_ends``: each rank's first step
    end; None for a rank that never completed one)."""
    if not first_ends or any(t is None for t in first_ends):
        return None
    return round(max(t for t in first_ends if t is not None) - started, 4)


def step_figures(ends: Sequence[tuple[int, float]], first_ends: Sequence[float | None],
                 started: float, steps: int, fault_step: int) -> dict[str, Any]:
    """Every step-time figure of a run: ``ends`` are rank 0's (step, end) pairs in run order,
    ``first_ends`` every rank's first step end, ``started`` the launch (epoch seconds)."""
    warm = warmup_end(steps, fault_step)
    return {"startup_s": startup_s(first_ends, started),
            "warmup_step_s": _round(mean_step_s(ends, 1, warm)),
            "steady_step_s": _round(mean_step_s(ends, *steady_window(steps, fault_step))),
            "window_step_s": _round(mean_step_s(ends, *capture_window(fault_step)))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def regained(steps: dict[int, list[tuple[int, float]]], kill: float,
             reached: int | None) -> float | None:
    """Seconds from the kill until every rank completed again the last step reached before
    it (``steps``: per rank, (step, epoch end)): recovery plus recomputing lost steps."""
    if not reached:
        return None
    ends = []
    for found in steps.values():
        again = [t for step, t in found if t > kill and step >= reached - 1]
        if not again:
            return None
        ends.append(min(again))
    return round(max(ends) - kill, 4)
