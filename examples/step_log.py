"""Per-step timings an example writes for the benchmarks in ``bench/``.

With a path prefix, each rank writes ``<prefix>.rank<r>.json`` at the end of its run:

* ``step_s``: wall seconds of each step it completed (snapshot capture included), in run
  order (a step a recovery aborted is left out);
* ``steps`` / ``ends``: the index of each step it completed and the epoch second it ended
  (after a rollback, replayed steps appear again: the order is the order they ran in);
* ``captured``: positions in ``step_s`` whose step ended with a snapshot capture.

While it runs, each completed step is also appended at once to ``<prefix>.rank<r>.live``
as a JSON line ``{"step", "t", "pid"}``: a benchmark watches it to kill a rank's process at
a given step (a replacement process appends to the same file).

Without a prefix every call is a no-op, so the examples run unchanged.
"""
from __future__ import annotations

import json
import os
import time
from typing import IO, Any


class StepLog:
    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._started = 0.0
        self._log: dict[str, list] = {"step_s": [], "steps": [], "ends": [], "captured": []}
        self._live: IO[str] | None = None

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
            self._live = open(f"{self._prefix}.rank{session.rank}.live", "a", buffering=1,
                              encoding="utf-8")
        self._live.write(json.dumps({"step": step, "t": self._log["ends"][-1],
                                     "pid": os.getpid()}) + "\n")
        stats = session.snapshot_stats
        if stats is not None and stats.last_capture_step == session.step_index:
            self._log["captured"].append(len(self._log["step_s"]) - 1)

    def write(self, rank: int) -> None:
        if self._live is not None:
            self._live.close()
        if self._prefix:
            with open(f"{self._prefix}.rank{rank}.json", "w", encoding="utf-8") as out:
                json.dump(self._log, out)
