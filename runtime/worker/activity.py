"""What a rank's training thread is doing, as its member record tells the launcher's stall
detector (``phalanx.recovery.detection.StallDetector``): inside a step or not, declared
busy or not, and how long its last completed step took."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Activity:
    """Written by the training thread (``enter_step``/``leave_step``/``busy``), read by the
    heartbeat thread (``extra``). ``grace_s``: how long after leaving a step the rank still
    counts as stepping, so the ordinary work between two steps (the next batch, a log line)
    neither changes the record nor excuses a rank frozen there; set it below the heartbeat
    interval so a longer pause (an evaluation pass) is published by the next beat.
    ``wake`` makes the heartbeat write at once (entering ``busy``)."""

    def __init__(self, grace_s: float, wake: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._wake = wake
        self._clock = clock
        self._in_step = False
        self._left_at: float | None = None     # clock time the last step ended
        self._left_wall = 0.0                  # the same, wall time (published)
        self._step_s = 0.0
        self._busy: list[str] = []             # nested busy() reasons, innermost last

    def enter_step(self) -> None:
        self._in_step = True

    def completing(self, step_s: float) -> None:
        """The step's work is done and its index is about to advance: its time is known
        first, so no record shows the new step with the previous step's time (the stall
        detector learns step times from the record that first shows a step)."""
        self._step_s = step_s

    def leave_step(self, completed_s: float | None) -> None:
        """The step ended; ``completed_s`` its wall time, None when it did not complete (a
        recovery rolled it back: its time is no step time)."""
        if completed_s is not None:
            self._step_s = completed_s
        self._in_step = False
        self._left_wall = time.time()
        self._left_at = self._clock()

    @contextmanager
    def busy(self, reason: str) -> Iterator[None]:
        """Mark the rank busy with ``reason`` for the block (nestable)."""
        self._busy.append(reason)
        self._wake()
        try:
            yield
        finally:
            self._busy.pop()

    def stepping(self) -> bool:
        """Inside a step, or left one less than ``grace_s`` ago (or none run yet)."""
        left = self._left_at
        return self._in_step or left is None or self._clock() - left < self._grace_s

    def extra(self) -> dict[str, Any]:
        """The member record's fields: ``in_step``, ``busy`` (the innermost reason or
        None), ``step_s`` and ``left_step_at`` (wall time the last step ended, 0: none)."""
        innermost = self._busy[-1:]     # one atomic read: the training thread may pop
        return {"in_step": self.stepping(), "busy": innermost[0] if innermost else None,
                "step_s": round(self._step_s, 6), "left_step_at": self._left_wall}
