"""Tracks the global commit point from the keepers' reports (``keepers/<node>``) and writes
``commit`` to etcd at most every ``replication.commit_every_steps`` steps (or every few
seconds when it moved), never per step per rank.

Only this run's keepers count: an etcd shared by launches of the same job can still hold
an earlier run's ``commit`` and ``keepers/<node>`` keys (until their leases lapse, or its
keepers linger), whose newer steps are not this run's. A launch resets ``commit``
(``reset_commit_point``) before its keepers start, and the tracker reads only the reports
of the keepers it was given."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.base import Membership, TableRead, read_table
from phalanx.runtime.commit import (COMMIT_KEY, KeeperReport, commit_value, committed_step, gate,
                                    reports_of)
from phalanx.runtime.consistency.digest import verified_ceiling

log = logging.getLogger(__name__)


def reset_commit_point(membership: Membership, now: float | None = None) -> None:
    """Write "nothing committed" to ``commit`` at a launch, before any keeper reads it (an
    earlier run's value would hand its step to this run's keepers and workers). Raises
    MembershipUnavailable."""
    membership.put(COMMIT_KEY, commit_value(-1, time.time() if now is None else now))


class CommitTracker:
    """Owned by the launcher's main thread; ``poll`` is cheap: it reads the keepers' reports
    and, for the replica gate, the members' records (two etcd range reads), or takes the
    watch loop's own read of both (``table``, read twice as often as this polls)."""

    def __init__(self, membership: Membership, world_size: int, factor: int,
                 every_steps: int, every_s: float = 5.0, read_every_s: float = 0.5,
                 keepers: Callable[[], Iterable[tuple[str, int]]] | None = None) -> None:
        """``keepers``: the addresses of this run's keepers (None: every report counts)."""
        self._membership = membership
        self._keepers = keepers
        self._ranks = list(range(world_size))
        self._factor = factor
        self._every_steps = every_steps
        self._every_s = every_s
        self._read_every_s = read_every_s
        self._last_read = 0.0
        self._written = -1
        self._written_at = 0.0
        self.committed = -1
        self.reports: dict[str, KeeperReport] = {}   # the keepers' reports last read

    def poll(self, now: float | None = None, table: TableRead | None = None) -> int:
        """``table``: a read of the member table taken since the last poll that read one
        (None: this poll reads etcd itself when due)."""
        now = time.monotonic() if now is None else now
        if now - self._last_read < self._read_every_s:
            return self.committed
        self._last_read = now
        try:
            read = table if table is not None else read_table(self._membership)
            self.reports = self._own(reports_of(read.keepers))
            step = committed_step(self.reports, self._ranks, self._factor)
            # never past a step the ranks' replica digests have not all agreed on
            step = gate(step, verified_ceiling(
                r.extra for r in read.members.values() if r.rank >= 0))
        except MembershipUnavailable as exc:
            log.warning("event=commit_read_failed error=%s", exc)
            return self.committed
        self.committed = max(self.committed, step)
        due = self.committed >= self._written + self._every_steps or (
            self.committed > self._written and now - self._written_at >= self._every_s)
        if due:
            try:
                self._membership.put(COMMIT_KEY, commit_value(self.committed, time.time()))
            except MembershipUnavailable as exc:   # written at a later poll
                log.warning("event=commit_write_failed step=%d error=%s", self.committed, exc)
                return self.committed
            self._written, self._written_at = self.committed, now
        return self.committed

    def settle(self, timeout_s: float, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> int:
        """At the job's end (the watch loop's thread): read until the commit point reaches
        the newest step every rank holds (its replicas and digests land a heartbeat after
        the last step) or ``timeout_s`` passes, then write it even when not due, so the
        keepers' tier persisters commit the last checkpoint. Returns the commit point."""
        deadline = clock() + timeout_s
        while True:
            self.poll(clock())
            held = committed_step(self.reports, self._ranks, 0)
            if self.committed >= held or clock() >= deadline:
                break
            sleep(self._read_every_s)
        if self.committed > self._written:
            try:
                self._membership.put(COMMIT_KEY, commit_value(self.committed, time.time()))
                self._written = self.committed
            except MembershipUnavailable as exc:
                log.warning("event=commit_write_failed step=%d error=%s", self.committed, exc)
        return self.committed

    def _own(self, reports: dict[str, KeeperReport]) -> dict[str, KeeperReport]:
        """The reports of this run's keepers; another run's are dropped (and logged)."""
        if self._keepers is None:
            return reports
        mine = {tuple(address) for address in self._keepers()}
        own = {node: r for node, r in reports.items() if tuple(r.address) in mine}
        if len(own) != len(reports):
            log.info("event=commit_reports_ignored nodes=%s reason=not_this_runs_keepers",
                     sorted(set(reports) - set(own)))
        return own
