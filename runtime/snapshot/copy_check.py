"""Whether a background snapshot copy saw its step boundary's state: the captured tensors'
version counters, recorded at the capture and compared once nothing can still be writing.

Every in-place torch op on a tensor (``p.add_()``, an EMA's ``mul_``, ``copy_``, under
``torch.no_grad()`` or on a ``detach()``-ed alias too) bumps the version counter that the
tensor shares with its views, *after* it wrote. A change between the capture and a point
where every op started before the copy ended has completed means the copy may hold bytes
of a later step (torn, or simply too new): the snapshot is never published as that step.
Writes through ``.data``, through a numpy view (``t.numpy()``) or from other threads are
not seen (docs/porting.md, "What the loop must not do").

    training thread   capture ──record──▶ forward/backward ──judge (fence)──▶ optimizer.step
    publish thread              copy+hash ───────▶ wait(verdict) ─▶ publish | drop
"""
from __future__ import annotations

import threading
from typing import Mapping

import torch

# How long the publishing thread waits for the training thread's verdict before judging
# itself: a loop with no fence (no registered optimizer) still publishes within this, and
# an in-place op that began before the copy ended has long finished by then.
VERDICT_WAIT_S = 2.0


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The version counter, or None for a tensor without one (an inference tensor)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


class CopyCheck:
    """One capture's check. ``CopyCheck(tensors)`` on the training thread at the step
    boundary; ``judge`` on the training thread at a fence (every op it started before the
    copy ended has completed: it waited for the copy, or blocks until the publish is over)
    or by ``wait`` on the publishing thread after ``VERDICT_WAIT_S``; ``wait`` returns the
    names of the tensors written since the capture (empty: the copy is the boundary's)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._versions = {name: tensor_version(t) for name, t in tensors.items()}
        self._lock = threading.Lock()
        self._judged = threading.Event()
        self._changed: tuple[str, ...] = ()

    def judge(self) -> None:
        """Compare the versions now with the capture's (once; later calls do nothing)."""
        with self._lock:
            if self._judged.is_set():
                return
            self._changed = tuple(name for name, version in self._versions.items()
                                  if version is not None
                                  and tensor_version(self._tensors[name]) != version)
            self._judged.set()

    @property
    def judged(self) -> bool:
        return self._judged.is_set()

    def wait(self, timeout_s: float | None = None) -> tuple[str, ...]:
        """The tensors written since the capture; judges itself after ``timeout_s``
        (``VERDICT_WAIT_S`` when None)."""
        if not self._judged.wait(VERDICT_WAIT_S if timeout_s is None else timeout_s):
            self.judge()
        return self._changed
