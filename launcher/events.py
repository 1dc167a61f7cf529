"""The job's event log: every fault, decision and phase change as one JSON line in the run
directory (``events.jsonl``) and, bounded, under ``events/`` in etcd for ``phalanx status``."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from configs.errors import MembershipUnavailable
from runtime.base import Membership

log = logging.getLogger(__name__)
EVENTS_PREFIX = "events/"
ETCD_EVENTS_KEPT = 100


class EventLog:
    """Thread-safe; ``emit`` never raises (a failing etcd only loses the etcd copy)."""

    def __init__(self, path: Path, membership: Membership | None = None) -> None:
        self._path = path
        self._membership = membership
        self._lock = threading.Lock()
        self._serial = 0
        self.events: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append to events.jsonl and put under ``events/`` in etcd."""
        return self._write(event, fields, to_etcd=True)

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append to events.jsonl only: routine per-node events (a tier write done) whose
        etcd copies would grow with nodes x steps."""
        return self._write(event, fields, to_etcd=False)

    def _write(self, event: str, fields: dict[str, Any], to_etcd: bool) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **fields}
        line = json.dumps(record, sort_keys=True, default=str)
        with self._lock:
            if to_etcd:  # numbers only the etcd copies, so the bound below stays exact
                self._serial += 1
            serial = self._serial
            self.events.append(record)
            with self._path.open("a", encoding="utf-8") as handle:
                handle.write(line + "\n")
        log.info("event=%s %s", event, " ".join(f"{k}={v!r}" for k, v in fields.items()))
        if to_etcd and self._membership is not None:
            try:
                self._membership.put(f"{EVENTS_PREFIX}{serial:010d}", line.encode())
                if serial > ETCD_EVENTS_KEPT:
                    self._membership.delete(f"{EVENTS_PREFIX}{serial - ETCD_EVENTS_KEPT:010d}")
            except MembershipUnavailable as exc:
                log.warning("event=event_not_in_etcd error=%s", exc)
        return record


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
