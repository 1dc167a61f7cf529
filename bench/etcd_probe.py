"""What an etcd server did during a window, as the benches measure it: its Prometheus
counters (``/metrics`` on the client port) before and after, and a prefix watch that tallies
the changes per key class (``members``, ``keepers``, ``commit``, ...) with their bytes.

Shared by ``bench/etcd_load.py`` (a real ``phalanx launch``) and ``bench/scale_sim.py``.
``etcd_mvcc_put_total`` counts every key written, inside transactions too.
"""
from __future__ import annotations

import json
import threading
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from phalanx.runtime.base import WatchEvent

# name in our reports -> etcd 3.5 metric; counters become rates, gauges stay values
COUNTERS = {
    "puts": "etcd_mvcc_put_total",
    "txns": "etcd_mvcc_txn_total",
    "deletes": "etcd_mvcc_delete_total",
    "ranges": "etcd_mvcc_range_total",
    "proposals": "etcd_server_proposals_committed_total",
    "lease_grants": "etcd_debugging_lease_granted_total",
    "lease_renewals": "etcd_debugging_lease_renewed_total",
    "lease_revokes": "etcd_debugging_lease_revoked_total",
    "rx_bytes": "etcd_network_client_grpc_received_bytes_total",
    "tx_bytes": "etcd_network_client_grpc_sent_bytes_total",
}
GAUGES = {"keys": "etcd_debugging_mvcc_keys_total", "db_bytes": "etcd_mvcc_db_total_size_in_bytes"}
# Loopback scrapes must never go through an HTTP(S)_PROXY from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(endpoint: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The counters and gauges above from ``http://<endpoint>/metrics`` (``host:port``).
    Raises OSError when etcd does not answer; a metric etcd lacks reads 0."""
    with _OPENER.open(f"http://{endpoint}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    wanted = {metric: name for name, metric in {**COUNTERS, **GAUGES}.items()}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric, _, value = line.partition(" ")
        if metric in wanted:
            values[wanted[metric]] = float(value)
    return {name: values.get(name, 0.0) for name in (*COUNTERS, *GAUGES)}


def rates(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Counters as per-second rates over the window, gauges as their value after it."""
    out = {name: (after[name] - before[name]) / seconds for name in COUNTERS}
    out.update({name: after[name] for name in GAUGES})
    return out


def key_class(key: str) -> str:
    """``members/w1-g0`` -> ``members``; ``generation`` -> ``generation``."""
    return key.split("/", 1)[0] or "(root)"


@dataclass
class ClassTally:
    events: int = 0
    bytes: int = 0          # key + value of each put (a delete: the key)


class WatchTally:
    """Counts every change under a job's prefix, per key class, on the watcher thread.

    ``watch`` is a ``Membership.watch_prefix``-like callable: (prefix, callback) -> cancel.
    """

    def __init__(self, watch: Callable[[str, Callable[[WatchEvent], None]], Callable[[], None]]):
        self._watch = watch
        self._lock = threading.Lock()
        self._tally: dict[str, ClassTally] = {}
        self._kinds: Counter[str] = Counter()
        self._event_names: Counter[str] = Counter()   # events/<serial>: the launcher's events
        self._cancel: Callable[[], None] | None = None

    def start(self) -> WatchTally:
        self._cancel = self._watch("", self._on_event)
        return self

    def stop(self) -> dict[str, Any]:
        """Stop watching; returns ``summary()``."""
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        return self.summary()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            classes = {name: {"events": t.events, "bytes": t.bytes}
                       for name, t in sorted(self._tally.items())}
            return {"classes": classes, "kinds": dict(self._kinds),
                    "event_names": dict(self._event_names.most_common()),
                    "events": sum(t.events for t in self._tally.values()),
                    "bytes": sum(t.bytes for t in self._tally.values())}

    def _on_event(self, event: WatchEvent) -> None:
        with self._lock:
            tally = self._tally.setdefault(key_class(event.key), ClassTally())
            tally.events += 1
            tally.bytes += len(event.key.encode()) + len(event.value)
            self._kinds[event.kind] += 1
            if event.kind == "put" and key_class(event.key) == "events":
                self._event_names[_event_name(event.value)] += 1


def _event_name(value: bytes) -> str:
    try:
        return str(json.loads(value).get("event", "?"))
    except (ValueError, AttributeError):
        return "?"
