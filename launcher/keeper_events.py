"""Keeper events into the job's event log: what each node keeper queued (a tier that
degraded, a replica push that failed, ...) polled without blocking the watch loop."""
from __future__ import annotations

import logging
from typing import Any

import ray
from rich.console import Console

from phalanx.launcher.events import EventLog
from phalanx.runtime.base import node_name

log = logging.getLogger(__name__)

KEEPER_EVENTS_EVERY_S = 1.0  # how often the watch loop asks each keeper for its events
KEEPER_EVENTS_FINAL_WAIT_S = 5.0
# Keeper events that are routine progress, one per node per persisted or committed step:
# events.jsonl (and the metrics) only, so etcd writes do not grow with nodes x steps (at 10
# steps/s with a tier every 10 steps, tier_committed alone was 1.9 etcd writes/s at 4
# nodes). Every other keeper event (an alert such as tier_degraded or replica_failed) also
# goes to etcd for `phalanx status`.
ROUTINE_KEEPER_EVENTS = frozenset({"tier_persisted", "tier_committed", "tier_retention"})
ALERT_KEEPER_EVENTS = frozenset({"tier_degraded", "tier_commit_abandoned", "tier_skipped",
                                 "persister_error", "replica_failed", "snapshot_unprotected"})


class KeeperEvents:
    """Forwards what each keeper queued (``tier_degraded``, ``replica_failed``, ...) into
    the job's EventLog, tagged with the keeper's node. Called from the watch loop's thread.

    ``poll`` never blocks: it collects answers that have arrived (``ray.wait`` with timeout
    0) and asks each live keeper again at most every ``every_s``, one request in flight per
    keeper. ``drain`` asks once more and waits up to ``timeout_s``, at the end of the run.
    """

    def __init__(self, keepers: dict[int, tuple[Any, tuple[str, int]]], events: EventLog,
                 console: Console, every_s: float = KEEPER_EVENTS_EVERY_S) -> None:
        self._keepers, self._events, self._console = keepers, events, console
        self._every_s = every_s
        self._asked: dict[int, Any] = {}  # node -> ref of its events() call in flight
        self._next_ask = 0.0
        self._alerted: set[tuple[str, str, str]] = set()

    def poll(self, live: set[int], now: float) -> None:
        if self._asked:
            self._collect(0)
        if now >= self._next_ask:
            self._next_ask = now + self._every_s
            self._ask(live)

    def drain(self, live: set[int], timeout_s: float) -> None:
        """Collect every keeper's events once more; a keeper slower than ``timeout_s`` is
        logged and skipped (the run is ending)."""
        try:
            self._ask(live)
            self._collect(timeout_s)
        except ray.exceptions.RayError as exc:  # Ray itself going away: keep the cause
            log.warning("event=keeper_events_lost error=%s", exc)
            return
        if self._asked:
            log.warning("event=keeper_events_late nodes=%s timeout_s=%.1f",
                        sorted(node_name(n) for n in self._asked), timeout_s)

    def _ask(self, live: set[int]) -> None:
        for node in sorted(live):
            if node in self._keepers and node not in self._asked:
                self._asked[node] = self._keepers[node][0].events.remote()

    def _collect(self, timeout_s: float) -> None:
        refs = {ref: node for node, ref in self._asked.items()}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            node = refs[ref]
            del self._asked[node]
            try:
                queued = ray.get(ref, timeout=0)
            except ray.exceptions.RayError as exc:  # the keeper died with its node
                log.info("event=keeper_events_unavailable node=%s error=%s",
                         node_name(node), type(exc).__name__)
                continue
            for event in queued:
                self._forward(node, event)

    def _forward(self, node: int, event: dict[str, Any]) -> None:
        fields = {k: v for k, v in event.items() if k not in ("event", "time")}
        fields.setdefault("node", node_name(node))
        kind = str(event.get("event", "keeper_event"))
        if kind in ROUTINE_KEEPER_EVENTS:
            self._events.record(kind, **fields)
            return
        self._events.emit(kind, **fields)
        key = (kind, str(fields.get("tier", "")), str(fields["node"]))
        if kind in ALERT_KEEPER_EVENTS and key not in self._alerted:
            self._alerted.add(key)  # once per kind, tier and node: the rest is in events.jsonl
            what = f"tier {key[1]} " if key[1] else ""
            self._console.print(f"phalanx: warning: {kind} {what}on {key[2]}: "
                                f"{fields.get('error') or fields.get('reason') or ''}",
                                highlight=False, markup=False)
