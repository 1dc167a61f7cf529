"""The training collective across generations: all-reduce as async work that is abandoned
(never destroyed: with gloo that blocks until the group timeout) as soon as a peer fails or
a newer generation is announced, and re-formed on a fresh ``PrefixStore`` per generation."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

from configs.errors import TransientError
from runtime.process_group import form_group

log = logging.getLogger(__name__)
_MAX_POLL_S = 0.002


class CollectiveAborted(TransientError):
    """A collective failed (a peer died or hung) or a newer generation began; the step is
    rolled back and re-run in the next generation."""


class Collective:
    """Owned by the Session on the training thread."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None
        self._parked: list[dist.ProcessGroup] = []
        self.generation = -1

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    def form(self, generation: int, rank: int | None = None, world_size: int | None = None) -> None:
        """Build ``generation``'s group (a barrier of every rank of that generation)."""
        if rank is not None:
            self._rank = rank
        if world_size is not None:
            self._world_size = world_size
        self.abandon()
        self._group = form_group(self._store, generation, self._rank, self._world_size,
                                 self._timeout_s)
        self.generation = generation

    def abandon(self) -> None:
        """Park the current group: its sockets stay open and any parked call fails later at
        its timeout, which nobody waits for."""
        if self._group is not None:
            self._parked.append(self._group)
            self._group = None

    def all_reduce(self, tensor: torch.Tensor, should_abort: Callable[[], bool]) -> torch.Tensor:
        """Sum ``tensor`` in place; raises ``CollectiveAborted`` on a peer failure or when
        ``should_abort()`` turns true while waiting."""
        if self._group is None:
            if self._world_size == 1:
                return tensor
            raise CollectiveAborted("no process group in this generation yet")
        try:
            work = self._group.allreduce([tensor])
        except RuntimeError as exc:
            raise CollectiveAborted(f"all_reduce could not start: {exc}") from None
        pause = 0.00002
        while not work.is_completed():
            if should_abort():
                raise CollectiveAborted("a newer generation began while waiting on all_reduce")
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_S)
        try:
            work.wait()
        except RuntimeError as exc:
            message = str(exc).splitlines()[0][-200:]
            raise CollectiveAborted(f"all_reduce failed: {message}") from None
        return tensor
