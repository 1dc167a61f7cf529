"""Per-step timings an example writes for the benchmarks in ``bench/``.

With a path prefix, each rank writes ``<prefix>.rank<r>.json`` at the end of its run:

* ``step_s``: wall seconds of each step it completed (snapshot capture included), in run
  order (a step a recovery aborted is left out);
* ``steps`` / ``ends``: the index of each step it completed and the epoch second it ended
  (after a rollback, replayed steps appear again: the order is the order they ran in);
* ``captured``: positions in ``step_s`` whose step ended with a snapshot capture.

While it runs, each completed step is also appended at once to ``<prefix>.rank<r>.live``
as a JSON line ``{"step", "t", "pid"}``, plus ``"replay": true`` for a step at or below the
highest step already in the file (redone after a rollback): a benchmark watches it to kill
a rank's process at a given step (a replacement process appends to the same file).

Without a prefix every call is a no-op, so the examples run unchanged.
"""
from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from phalanx.runtime.logs import ReplayMarker


class StepLog:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._started = 0.0
        self._log: dict[str, list] = {"step_s": [], "steps": [], "ends": [], "captured": []}
        self._live: IO[str] | None = None
        self._replays = ReplayMarker()

    def begin(self) -> None:
        self._started = time.perf_counter()

    def end(self, session: Any, step: int) -> None:
        """After ``with session.step() as step`` ended: records ``step`` if it completed."""
        if not self._prefix or session.step_index != step + 1:
            return
        self._log["step_s"].append(time.perf_counter() - self._started)
        self._log["steps"].append(step)
        self._log["ends"].append(time.time())
        if self._live is None:
            path = f"{self._prefix}.rank{session.rank}.live"
            self._replays = ReplayMarker(_highest_step(path))   # a replacement continues it
            self._live = open(path, "a", buffering=1, encoding="utf-8")
        line: dict[str, Any] = {"step": step, "t": self._log["ends"][-1], "pid": os.getpid()}
        if self._replays.mark(step):
            line["replay"] = True
        self._live.write(json.dumps(line) + "\n")
        stats = session.snapshot_stats
        if stats is not None and stats.last_capture_step == session.step_index:
            self._log["captured"].append(len(self._log["step_s"]) - 1)

    def write(self, rank: int) -> None:
        if self._live is not None:
            self._live.close()
        if self._prefix:
            with open(f"{self._prefix}.rank{rank}.json", "w", encoding="utf-8") as out:
                json.dump(self._log, out)


def _highest_step(path: str) -> int:
    """The highest step a live file already holds (-1: none, or no file)."""
    highest = -1
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    highest = max(highest, int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                    continue
    except OSError:
        return -1
    return highest
