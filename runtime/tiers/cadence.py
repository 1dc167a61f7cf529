"""Which step a tier persists: one pure rule every node applies alone, without talking to
the others.

    windows of every_steps=20:  [0, 20)    [20, 40)      [40, 60)      [60, 80)
    snapshot steps (every 3):   0 .. 18    21 24 .. 39   42 45 .. 57   60 63 ..
    persisted:                  -          21            42            60

The first snapshot step of each window of ``every_steps`` steps (never window 0). Ranks
snapshot at the same steps, so every node that sees a window's first step picks it and the
commit, which needs every rank of the job, completes. A node whose poll missed that step
persists a later one of the window, which never commits (superseded or abandoned; retention
removes it); windows are fixed multiples, not counted from the last attempt, so the next
window agrees again. ``every_s`` opens wall-clock windows too (multiples of every_s since
the epoch: the same on every node with synchronized clocks); the first poll in a new one
persists the oldest held step newer than the last attempt. With ``snapshot.every_steps:
auto`` the ranks agree on one interval at every snapshot step and every few steps between
(``Session._agree_interval``), so they snapshot the same steps too; a step not held by
every local rank is never persisted.
``every_steps`` 0 (a tier at ``every_steps: auto`` while the snapshot interval is auto) has
no windows: every full snapshot step is persisted, oldest first, which every node walks
alike (a step a node no longer holds when its poll comes is skipped there and never
commits; the next one agrees again).

"""
from __future__ import annotations

from typing import Iterable


def pick_step(ready: Iterable[int], attempted: int, every_steps: int,
              time_due: bool = False) -> int | None:
    """The step to persist now, or None (pure; see the module docstring).

    ``ready``: steps every local rank holds; ``attempted``: the newest step tried (0
    before the first). A newer window of ``every_steps`` than ``attempted``'s → the oldest
    ready step of the newest such window; else, when ``time_due``, the oldest ready step
    newer than ``attempted``. ``every_steps`` 0: the oldest ready step newer than
    ``attempted``."""
    fresh = sorted(s for s in ready if s > attempted)
    if not fresh:
        return None
    if every_steps == 0:
        return fresh[0]
    window = fresh[-1] // every_steps
    if window > max(attempted, 0) // every_steps:
        return min(s for s in fresh if s // every_steps == window)
    return fresh[0] if time_due else None
