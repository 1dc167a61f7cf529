"""The job's event log: every fault, decision and phase change as one JSON line in the run
directory (``events.jsonl``) and, bounded, under ``events/`` in etcd for ``phalanx status``."""
from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.base import Membership
from phalanx.runtime.logs import quote

log = logging.getLogger(__name__)
EVENTS_PREFIX = "events/"
ETCD_EVENTS_KEPT = 100
ETCD_QUEUE = 1000                  # etcd copies waiting to be written, at most


class EventLog:
    """Thread-safe; ``emit`` never raises (a failing etcd only loses the etcd copy).

    events.jsonl is written at once; the etcd copies go through one writer thread, so a
    recovery's phase changes never wait for etcd round trips. ``close`` (or ``flush``)
    waits for them."""

    def __init__(self, path: Path, membership: Membership | None = None) -> None:
        self._path = path
        self._membership = membership
        self._lock = threading.Lock()
        self._serial = 0
        self.events: list[dict[str, Any]] = []
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(ETCD_QUEUE)
        self._writer: threading.Thread | None = None
        if membership is not None:
            self._writer = threading.Thread(target=self._write_etcd, name="phalanx-events",
                                            daemon=True)
            self._writer.start()

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener`` with every record once it is written (on the emitting thread,
        outside the log's lock; it must not block). What it raises is logged and dropped."""
        self._listeners.append(listener)

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
        log.info("event=%s %s", event, " ".join(  # logfmt values: one field each, whole
            f"{k}={quote(v if isinstance(v, str) else json.dumps(v, default=str))}"
            for k, v in fields.items()))
        if to_etcd and self._writer is not None:
            try:
                self._queue.put_nowait((serial, line.encode()))
            except queue.Full:
                log.warning("event=event_not_in_etcd serial=%d error=queue full", serial)
        for listener in list(self._listeners):
            try:
                listener(record)
            except Exception:  # a listener's bug (metrics) must not fail the job's events
                log.exception("event=event_listener_failed listener=%r event=%s", listener,
                              event)
        return record

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (up to ``timeout_s``) until every queued etcd copy was written."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._writer is None:
            return
        self.flush(timeout_s)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._writer.join(timeout_s)
        self._writer = None

    def _write_etcd(self) -> None:
        assert self._membership is not None
        while (item := self._queue.get()) is not None:
            serial, line = item
            try:
                self._membership.put(f"{EVENTS_PREFIX}{serial:010d}", line)
                if serial > ETCD_EVENTS_KEPT:
                    self._membership.delete(f"{EVENTS_PREFIX}{serial - ETCD_EVENTS_KEPT:010d}")
            except MembershipUnavailable as exc:
                log.warning("event=event_not_in_etcd serial=%d error=%s", serial, exc)
            except Exception:  # thread boundary: the JSONL copy is already written
                log.exception("event=event_not_in_etcd serial=%d", serial)
            finally:
                self._queue.task_done()
        self._queue.task_done()


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
