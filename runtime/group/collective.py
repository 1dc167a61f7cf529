"""The training collective across generations: all-reduce as async work that is abandoned
(never destroyed on the training thread: with gloo that blocks until the group timeout) as
soon as a peer fails or a newer generation is announced, and re-formed on a fresh
``PrefixStore`` per generation. Once the next group formed, the abandoned ones are aborted
and dropped on a reaper thread, so their sockets are given back (at once after a peer
died; at the group timeout when a parked call still waits on a hung peer)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.configs.errors import TransientError
from phalanx.runtime.group.process_group import form_group

log = logging.getLogger(__name__)
_MAX_POLL_S = 0.002


class CollectiveAborted(TransientError):
    """A collective failed (a peer died or hung) or a newer generation began; the step is
    rolled back and re-run in the next generation."""


class Collective:
    """Owned by the Session on the training thread."""

    def __init__(self, connect: Callable[[], dist.Store], rank: int, world_size: int,
                 timeout_s: float) -> None:
        """``connect`` opens a client of the job's TCPStore: one per formation that starts
        while an abandoned one still blocks its client (a TCPStore client serves one call
        at a time, so the stuck barrier would hold the next one until its timeout)."""
        self._connect = connect
        self._store = connect()
        self._forming: threading.Thread | None = None
        self._rank = rank
        self._world_size = world_size
        self._timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None
        self._parked: list[dist.ProcessGroup] = []
        self._reapers: list[threading.Thread] = []
        self.generation = -1
        # set by the default group when one of its collectives failed in this generation;
        # cleared when the next generation's group forms
        self.fault: str | None = None
        # a Session is attached: failed collectives complete as no-ops, the step rolls back
        self.absorb_faults = False
        self.superseded: Callable[[], bool] = lambda: False
        self._announced: list[Callable[[], None]] = []

    def on_announced(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a generation is announced (``generation_announced``):
        the default group completes the collectives a superseded generation still waits
        on, with no thread polling ``superseded`` while they run."""
        self._announced.append(listener)

    def generation_announced(self) -> None:
        """A newer generation may have been announced (the Session's generation watcher
        calls this from its watch thread): ``superseded`` says whether it was."""
        for listener in list(self._announced):
            listener()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def store(self) -> dist.Store:
        return self._store

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def mark_fault(self, reason: str) -> None:
        """Record that this generation's group failed (the first reason is kept)."""
        if self.fault is None:
            self.fault = reason
            log.warning("event=default_group_fault generation=%d reason=%r", self.generation,
                        reason[:500])

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    def form(self, generation: int, rank: int | None = None, world_size: int | None = None,
             should_abort: Callable[[], bool] = lambda: False) -> None:
        """Build ``generation``'s group (a barrier of every rank of that generation).

        The barrier runs on a helper thread while this one polls ``should_abort``: a peer
        that never comes (its node died before anyone noticed) or a newer generation
        announced meanwhile raises ``CollectiveAborted`` at once instead of blocking until
        the group timeout; the half-built group is parked, like an abandoned collective."""
        if rank is not None:
            self._rank = rank
        if world_size is not None:
            self._world_size = world_size
        self.abandon()
        if self._forming is not None and self._forming.is_alive():
            self._store = self._connect()
        store = self._store
        self._group = self._watched(
            lambda: form_group(store, generation, self._rank, self._world_size,
                               self._timeout_s),
            should_abort, f"generation {generation}'s group", track=True)
        self.generation = generation
        self.fault = None
        self._release_parked()

    def form_subgroup(self, name: str, rank: int, size: int, timeout_s: float
                      ) -> dist.ProcessGroup:
        """Build this generation's gloo group of some of its ranks (``rank`` and ``size``
        within it; ``name`` tells it from the others) on a store client of its own, while
        this thread looks for a newer generation (under a Session): a member that died
        before it came raises ``CollectiveAborted`` when the recovery is announced, not
        after the group timeout. Raises ``CollectiveAborted`` when it did not form."""
        generation = self.generation
        return self._watched(
            lambda: form_group(self._connect(), generation, rank, size, timeout_s, name),
            lambda: self.absorb_faults and self.superseded(),
            f"{name} of generation {generation}")

    def _watched(self, build: Callable[[], dist.ProcessGroup], should_abort: Callable[[], bool],
                 what: str, track: bool = False) -> dist.ProcessGroup:
        """``build()`` (a gloo group's rendezvous) on a helper thread while this one polls
        ``should_abort``: raises ``CollectiveAborted`` when it turns true (the half-built
        group is parked, like an abandoned collective, once it forms) or when the build
        failed. ``track``: the thread is the one a next ``form`` looks at (its store client
        may be blocked in it)."""
        built: dict[str, Any] = {}

        def run() -> None:
            try:
                built["group"] = build()
            except Exception as exc:  # the thread's boundary: becomes CollectiveAborted
                built["error"] = exc
            if "group" in built and built.get("abandoned"):
                self._parked.append(built["group"])   # formed too late: reaped later

        thread = threading.Thread(target=run, name=f"phalanx-form {what}", daemon=True)
        if track:
            self._forming = thread
        thread.start()
        pause = 0.0005
        while thread.is_alive():
            if should_abort():
                built["abandoned"] = True
                raise CollectiveAborted(f"a newer generation began while {what} was forming")
            thread.join(pause)
            pause = min(pause * 2, 0.02)
        if "error" in built:
            raise CollectiveAborted(f"{what} did not form: {_whole(built['error'])}")
        return built["group"]

    def park(self, group: dist.ProcessGroup) -> None:
        """Leave ``group`` (a group of an earlier generation) to be aborted and dropped
        with the groups the next ``form`` or ``release_parked`` releases. The caller drops
        its own references before that release: the reaper thread must hold the last one,
        or the group's destructor runs on the caller's thread when the caller drops it, and
        blocks there until a call parked on a hung peer times out (a ``SubGroup``'s
        training thread stalled 30 s in it, and its peer's next group never formed)."""
        self._parked.append(group)

    def release_parked(self) -> None:
        """Hand the parked groups to a reaper thread now, when this generation's group has
        formed (else the next ``form`` does)."""
        if self._group is not None:
            self._release_parked()

    def _release_parked(self) -> None:
        """Hand the parked groups to a reaper thread that aborts and drops them (their
        sockets close). It may block until a parked call's timeout; only the
        process's exit waits for it."""
        parked, self._parked = self._parked, []
        if parked:
            # Not a daemon: the interpreter's shutdown waits for it. A daemon thread still
            # in a group's destructor when the process exits is cut off by Python's
            # finalization (pthread_exit inside a noexcept C++ frame) and the process
            # aborts with SIGABRT ("terminate called without an active exception"):
            # measured on 2 processes exiting right after a re-form, 4 runs of 6 aborted.
            reaper = threading.Thread(target=_reap, args=(parked, self.generation),
                                      daemon=False,
                                      name=f"phalanx-group-reaper-gen{self.generation}")
            self._reapers = [t for t in self._reapers if t.is_alive()] + [reaper]
            reaper.start()

    def wait_released(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every abandoned group is torn down; True when
        none is left. A rank calls it before it reports itself finished: its peers'
        processes then outlive its teardowns (a peer that exits while this process is in
        a group's destructor can abort it, "Resource deadlock avoided", 2 of 8 runs)."""
        deadline = time.monotonic() + timeout_s
        for reaper in self._reapers:
            reaper.join(max(0.0, deadline - time.monotonic()))
        self._reapers = [t for t in self._reapers if t.is_alive()]
        return not self._reapers

    @property
    def parked(self) -> int:
        """Groups abandoned and not yet handed to a reaper."""
        return len(self._parked)

    def use_store(self, connect: Callable[[], dist.Store]) -> None:
        """Form later generations on another TCPStore (a standby coordinator took over and
        hosts its own); the old store's clients are left to close with their groups."""
        self._connect = connect
        self._store = connect()

    def abandon(self) -> None:
        """Park the current group: nothing on this thread waits for it (a parked call fails
        later, which nobody reads); the next ``form`` hands it to a reaper thread."""
        if self._group is not None:
            self._parked.append(self._group)
            self._group = None

    def all_reduce(self, tensor: torch.Tensor, should_abort: Callable[[], bool]) -> torch.Tensor:
        """Sum ``tensor`` in place; raises ``CollectiveAborted`` on a peer failure or when
        ``should_abort()`` turns true while waiting."""
        return self.wait(self.start_all_reduce(tensor), tensor, should_abort)

    def start_all_reduce(self, tensor: torch.Tensor) -> Any:
        """Begin summing ``tensor`` in place; ``wait`` for the returned work (None in a
        one-rank job) before reading it. Every rank must start it at the same point."""
        if self._group is None:
            if self._world_size == 1:
                return None
            raise CollectiveAborted("no process group in this generation yet")
        try:
            return self._group.allreduce([tensor])
        except RuntimeError as exc:
            raise CollectiveAborted(f"all_reduce could not start: {exc}") from None

    def start_broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        """Begin sending ``tensor`` from rank ``src`` to every rank (in place); ``wait`` for
        the returned work. Every rank must start it at the same point."""
        if self._group is None:
            if self._world_size == 1:
                return None
            raise CollectiveAborted("no process group in this generation yet")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        try:
            return self._group.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise CollectiveAborted(f"broadcast could not start: {exc}") from None

    @staticmethod
    def wait(work: Any, tensor: torch.Tensor, should_abort: Callable[[], bool]) -> torch.Tensor:
        """``tensor`` once ``work`` completed; raises ``CollectiveAborted`` like
        ``all_reduce``."""
        if work is None:
            return tensor
        pause = 0.00002
        while not work.is_completed():
            if should_abort():
                raise CollectiveAborted("a newer generation began while waiting on all_reduce")
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_S)
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveAborted(f"all_reduce failed: {_whole(exc)}") from None
        return tensor


def _reap(parked: list[dist.ProcessGroup], generation: int) -> None:
    """The reaper thread: ``abort()`` each abandoned group (torch 2.13's gloo has it; it
    fails the parked calls, whose results nobody reads any more), then drop it. Measured
    on gloo, 2 ranks: a group whose peer is gone goes in milliseconds; one with a call
    parked on a hung peer blocks here until its timeout, as ``shutdown()`` and a plain
    drop do too."""
    started = time.monotonic()
    count = len(parked)
    while parked:
        group = parked.pop()
        abort = getattr(group, "abort", None)
        try:
            if abort is not None:
                abort()
        except Exception as exc:  # the thread's boundary: a group that will not abort is dropped
            log.info("event=parked_group_abort_failed generation=%d error=%s", generation,
                     _whole(exc))
        del group, abort
    log.info("event=parked_groups_released count=%d before_generation=%d seconds=%.3f", count,
             generation, time.monotonic() - started)


def _whole(exc: BaseException) -> str:
    """An error's whole message on one line, never cut: gloo puts the cause at the end of a
    long first line (``[../gloo/transport/tcp/pair.cc:534] Connection closed by peer
    [127.0.0.1]:29500``). A C++ stack torch may append (``Exception raised from ...``,
    ``frame #0: ...``) is left out: it is no part of the message."""
    lines = []
    for line in str(exc).splitlines():
        if line.startswith(("Exception raised from ", "frame #")):
            break
        if line.strip():
            lines.append(line.strip())
    return " | ".join(lines)
