"""The launcher's view of etcd being unreachable (a restart, a blip): the watch loop goes on
with the member table of the last good read, and for a grace period after etcd answers
again, vanished or stale member keys and frozen progress prove nothing about the workers.

It is also where the watch loop reads the member table, at most every ``min_interval_s``
unless asked for a fresh one: the records change once a heartbeat (each keeper rewrites its
node's report every ``etcd.heartbeat_s``), while the loop polls its workers every
``detection.poll_interval_s``. Reading the table at every poll was 19 of the 40 etcd range
reads a second of a steady world-2 job, and etcd then took 6% of a core of a 2-core
machine whose other 94% the ranks want."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.base import MemberRecord, Membership, TableRead, read_table

log = logging.getLogger(__name__)
OUTAGE_BUDGET_S = 60.0     # etcd unreachable longer than this ends the job


def outage_grace_s(lease_ttl_s: float) -> float:
    """How long after etcd answers again lease and progress signals are not trusted: a
    lease the outage cost is learnt at the keepalive's next refresh (within a third of a
    TTL) and its holder joins again at its next heartbeat; a second TTL covers a busy
    machine."""
    return 2.0 * lease_ttl_s


class EtcdOutage:
    """Owned by the launcher's main thread: ``members()`` replaces ``membership.members()``
    in the watch loop, ``trusted()`` gates lease signals, ``on_untrusted`` (the stall
    detector's reset) runs at every poll etcd is down or in its grace period. ``last`` is
    the last good read (with the keepers' reports, which the commit tracker reuses).

    ``members()`` raises ``MembershipUnavailable`` once etcd has been unreachable for
    ``budget_s``; ``emit(event, **fields)`` records ``etcd_unreachable`` and
    ``etcd_reachable`` (what the launcher saw; a drill's own events are ``etcd_down/up``)."""

    def __init__(self, membership: Membership, emit: Callable[..., Any], grace_s: float,
                 on_untrusted: Callable[[], None] = lambda: None,
                 budget_s: float = OUTAGE_BUDGET_S, min_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._membership = membership
        self._emit = emit
        self._grace_s = grace_s
        self._on_untrusted = on_untrusted
        self._budget_s = budget_s
        self._min_interval_s = min_interval_s
        self._clock = clock
        self.last = TableRead({}, [])
        self._read_at = -float("inf")
        self._down_since: float | None = None
        self._grace_until = 0.0
        self.outages = 0

    def members(self, fresh: bool = False) -> Mapping[str, MemberRecord]:
        """The member table now (read again only ``min_interval_s`` after the last good
        read, or when ``fresh``), or the last one read while etcd is unreachable."""
        now = self._clock()
        if fresh or now - self._read_at >= self._min_interval_s:
            try:
                self.last = read_table(self._membership)
            except MembershipUnavailable as exc:
                self._failed(now, exc)
            else:
                self._answered(now)
                self._read_at = now
        if not self.trusted(now):
            self._on_untrusted()
        return self.last.members

    def trusted(self, now: float | None = None) -> bool:
        """Whether etcd answers and has for the grace period: member keys mean something."""
        now = self._clock() if now is None else now
        return self._down_since is None and now >= self._grace_until

    def _failed(self, now: float, exc: MembershipUnavailable) -> None:
        if self._down_since is None:
            self._down_since = now
            self.outages += 1
            log.warning("event=etcd_unreachable error=%s", exc)
            self._emit("etcd_unreachable", error=str(exc)[:300])
        elif now - self._down_since > self._budget_s:
            raise MembershipUnavailable(
                f"etcd unreachable for {now - self._down_since:.1f} s, longer than the "
                f"launcher rides out ({self._budget_s:.0f} s): {exc}") from exc

    def _answered(self, now: float) -> None:
        if self._down_since is None:
            return
        down_s = now - self._down_since
        self._down_since = None
        self._grace_until = now + self._grace_s
        log.warning("event=etcd_reachable down_s=%.3f grace_s=%.1f", down_s, self._grace_s)
        self._emit("etcd_reachable", down_s=round(down_s, 3), grace_s=self._grace_s)
