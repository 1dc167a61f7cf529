"""A rank's restore in a new generation, told to the other ranks and the coordinator through
etcd (``restore/<generation>/<rank>``), so a restore longer than ``recovery.group_timeout_s``
(a spare pulling a large state from a remote keeper or a tier) is waited for instead of
timing the group out.

While it restores, a rank refreshes its key every heartbeat (``restoring``); once restored
it writes ``restored``. Ranks form the generation's group first (a spare before its
restore), and before the group's first collective a rank that restored waits until every
other rank of the generation has restored (no collective times out meanwhile): a rank still
reporting its restore is waited for, up to ``restore_bound_s`` after the wait began; a rank
that never reported one for ``recovery.group_timeout_s``, or whose reports stopped, is
not: the first collective times out as before, and the coordinator fails the job naming it
(``GroupNotReformed``).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

RESTORING = "restoring"
RESTORED = "restored"
# A restore still reporting progress is waited for up to this long (or 10 x the group
# timeout, if longer) after its generation's plan: the bound of a slow restore.
RESTORE_WAIT_MIN_S = 120.0
RESTORE_WAIT_FACTOR = 10.0
# Drills and tests: a rank started by a recovery (a promoted spare, a fresh worker) sleeps
# this many seconds inside its restore, reporting progress, as a slow restore would.
SLOW_RESTORE_ENV = "PHALANX_DRILL_SLOW_RESTORE_S"


def restore_bound_s(group_timeout_s: float) -> float:
    """How long a generation's ranks (and the coordinator) wait for a rank that still
    reports its restore before giving up on it."""
    return max(RESTORE_WAIT_MIN_S, RESTORE_WAIT_FACTOR * group_timeout_s)


def stale_after_s(heartbeat_s: float) -> float:
    """A restore whose last report is older than this is no longer in progress."""
    return max(2.0, 4 * heartbeat_s)


def restore_key(generation: int, rank: int) -> str:
    return f"restore/{generation}/{rank}"


@dataclass(frozen=True)
class RestoreReport:
    """One rank's restore in one generation, as its key holds it."""

    worker: str
    state: str            # RESTORING or RESTORED
    started: float        # wall clock
    time: float           # wall clock of the last report

    def encode(self) -> bytes:
        return json.dumps({"worker": self.worker, "state": self.state,
                           "started": self.started, "time": self.time}).encode()

    @staticmethod
    def decode(raw: bytes) -> "RestoreReport | None":
        try:
            doc = json.loads(raw)
            return RestoreReport(str(doc["worker"]), str(doc["state"]), float(doc["started"]),
                                 float(doc["time"]))
        except (ValueError, KeyError, TypeError):
            return None

    def in_progress(self, now: float, stale_s: float) -> bool:
        return self.state == RESTORING and now - self.time <= stale_s

    def formed_within(self, now: float, forming_s: float) -> bool:
        """Restored less than ``forming_s`` ago: still forming its group."""
        return self.state == RESTORED and now - self.time <= forming_s


def read_reports(membership: Any, generation: int) -> dict[int, RestoreReport]:
    """Rank -> its restore report in ``generation``."""
    reports = {}
    for item in membership.list_prefix(f"restore/{generation}/"):
        key = item.key.decode() if isinstance(item.key, bytes) else str(item.key)
        report = RestoreReport.decode(item.value)
        if report is not None and key.rsplit("/", 1)[-1].isdigit():
            reports[int(key.rsplit("/", 1)[-1])] = report
    return reports


@contextmanager
def reporting(membership: Any, generation: int, rank: int, worker: str,
              heartbeat_s: float, slow_s: float = 0.0) -> Iterator[None]:
    """Report this rank's restore while the block runs (``restoring`` every heartbeat),
    then ``restored`` when it succeeded. ``slow_s``: a drill's slow restore."""
    if membership is None:
        yield
        return
    started = time.time()
    key = restore_key(generation, rank)
    stop = threading.Event()

    def put(state: str) -> None:
        try:
            membership.put(key, RestoreReport(worker, state, started, time.time()).encode())
        except Exception as exc:  # etcd blip: the next report (or the group) decides
            log.warning("event=restore_report_failed rank=%d error=%r", rank, exc)

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            put(RESTORING)

    put(RESTORING)
    thread = threading.Thread(target=beat, daemon=True, name=f"phalanx-restore-{generation}")
    thread.start()
    try:
        if slow_s > 0:
            log.warning("event=drill_slow_restore rank=%d seconds=%.1f", rank, slow_s)
            time.sleep(slow_s)
        yield
    finally:
        stop.set()
        thread.join()
    put(RESTORED)


def drill_slow_restore_s(drills: bool) -> float:
    """The drill's slow restore (``PHALANX_DRILL_SLOW_RESTORE_S``), only in drill runs."""
    if not drills:
        return 0.0
    try:
        return max(0.0, float(os.environ.get(SLOW_RESTORE_ENV, "0") or 0))
    except ValueError:
        return 0.0


def wait_restored(membership: Any, generation: int, world_size: int, rank: int, *,
                  group_timeout_s: float, heartbeat_s: float,
                  should_abort: Callable[[], bool],
                  sleep: Callable[[float], None] = time.sleep) -> list[int]:
    """Wait until every other rank of ``generation`` restored (see the module docstring);
    returns the ranks it stopped waiting for (empty: all restored)."""
    if membership is None:
        return []
    began = time.time()
    bound, stale = restore_bound_s(group_timeout_s), stale_after_s(heartbeat_s)
    others = [r for r in range(world_size) if r != rank]
    pause = 0.005           # restores from memory end in milliseconds: look again soon
    while True:
        try:
            reports = read_reports(membership, generation)
        except Exception as exc:  # etcd unreachable: form the group and let it decide
            log.warning("event=restore_wait_failed rank=%d error=%r", rank, exc)
            return others
        now = time.time()
        missing = [r for r in others if r not in reports or reports[r].state != RESTORED]
        waiting = [r for r in missing if (reports[r].in_progress(now, stale) if r in reports
                                          else now - began < group_timeout_s)]
        if not missing:
            return []
        if waiting != missing or should_abort() or now - began > bound:
            log.warning("event=restore_wait_ended rank=%d generation=%d missing=%s "
                        "seconds=%.1f", rank, generation, missing, now - began)
            return missing
        sleep(min(pause, 0.1, heartbeat_s))
        pause *= 2
