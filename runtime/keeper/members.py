"""The node's ranks' member records, held by the node keeper so that etcd sees one lease and
one heartbeat per node (DESIGN: control-plane load O(nodes / heartbeat), never O(ranks)).

A rank sends its record to its keeper when it changes and a bare beat otherwise
(``member_beat``, over the keeper's own connection, local to the node); the keeper's
reporter publishes every record it holds inside its ``keepers/<node>`` report, under its
lease. A rank silent for its TTL (frozen, killed, cut off) is dropped, exactly as its own
lease would have lapsed, so the launcher sees its record vanish. A rank that comes back
after that is told its record is gone (``known: false``) and joins again, after checking
it was not replaced meanwhile (``phalanx.runtime.worker.heartbeat``). Beats are not fenced
by generation: whose record counts is the launcher's judgement (its slots), not the
keeper's.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from phalanx.runtime.keeper.wire import KeeperRequestInvalid, OpHandler, Unfenced
from phalanx.runtime.transport.tcp import Reply, Request

MAX_RECORD_BYTES = 64 << 10


@dataclass
class _Row:
    record: dict[str, Any]
    ttl_s: float
    seen_at: float
    version: int
    published: int = 0      # the version the reporter last wrote to etcd
    leaving: bool = False   # left: dropped once its last version was published


class NodeMembers:
    """Thread-safe: beats arrive on keeper connection threads, the reporter thread reads.
    ``clock`` is monotonic seconds (tests pass a manual one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rows: dict[str, _Row] = {}
        self._versions = 0
        self.urgent = threading.Event()     # a beat that asked to be published at once

    def beat(self, worker_id: str, record: Mapping[str, Any] | None, ttl_s: float,
             join: bool = False, urgent: bool = False) -> dict[str, bool]:
        """A rank's beat: its new ``record``, or None (unchanged, still alive). ``join``
        (re)registers it; without it, a rank the keeper does not hold (never joined, or
        dropped after its TTL) is answered ``known: false`` and nothing is stored.
        ``published``: the keeper's etcd report holds the rank's latest record."""
        now = self._clock()
        with self._lock:
            row = self._rows.get(worker_id)
            if row is not None and now - row.seen_at > row.ttl_s:
                del self._rows[worker_id]       # it lapsed before the reporter noticed
                row = None
            if row is None and not join:
                return {"known": False, "published": False}
            if record is not None or row is None:
                if record is None:
                    raise KeeperRequestInvalid(f"member {worker_id!r} joined without a record")
                self._versions += 1
                row = self._rows[worker_id] = _Row(
                    dict(record), ttl_s, now, self._versions,
                    published=row.published if row is not None else 0)
            row.seen_at, row.ttl_s, row.leaving = now, ttl_s, False
            published = row.published == row.version
        if urgent or (record is not None and join):
            self.urgent.set()
        return {"known": True, "published": published}

    def leave(self, worker_id: str) -> None:
        """The rank left on purpose: dropped once its last record reached etcd (a finishing
        rank's ``finished`` record is seen before it vanishes)."""
        with self._lock:
            row = self._rows.get(worker_id)
            if row is None:
                return
            if row.published == row.version:
                del self._rows[worker_id]
            else:
                row.leaving = True
        self.urgent.set()

    def current(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """The records to publish now (ranks past their TTL dropped first) and the versions
        they are at, to hand to ``published`` once etcd took them."""
        now = self._clock()
        with self._lock:
            for worker_id, row in list(self._rows.items()):
                if now - row.seen_at > row.ttl_s:
                    del self._rows[worker_id]
            rows = dict(self._rows)
        return ({w: r.record for w, r in rows.items()}, {w: r.version for w, r in rows.items()})

    def published(self, versions: Mapping[str, int]) -> None:
        """etcd holds these versions now; ranks that left and were published are dropped."""
        with self._lock:
            for worker_id, version in versions.items():
                row = self._rows.get(worker_id)
                if row is None or row.version != version:
                    continue
                row.published = version
                if row.leaving:
                    del self._rows[worker_id]

    def ops(self) -> dict[str, OpHandler]:
        """The keeper's ``member_beat`` and ``member_leave`` ops (registered through its op
        port, unfenced)."""
        return {"member_beat": Unfenced(self._beat_op), "member_leave": Unfenced(self._leave_op)}

    def _beat_op(self, keeper: Any, request: Request) -> Reply:
        h = request.header
        worker_id, ttl_s = h.get("worker"), h.get("ttl_s")
        if not isinstance(worker_id, str) or not worker_id or \
                not isinstance(ttl_s, (int, float)) or ttl_s <= 0:
            raise KeeperRequestInvalid(f"member_beat needs a worker and a positive ttl_s, got "
                                       f"{worker_id!r} and {ttl_s!r}")
        size = request.payload.remaining
        if size > MAX_RECORD_BYTES:
            raise KeeperRequestInvalid(f"member record of {size} bytes is over "
                                       f"{MAX_RECORD_BYTES}")
        record = _decode(bytes(request.payload.read(size))) if size else None
        return Reply(self.beat(worker_id, record, float(ttl_s), join=bool(h.get("join")),
                               urgent=bool(h.get("urgent"))))

    def _leave_op(self, keeper: Any, request: Request) -> Reply:
        worker_id = request.header.get("worker")
        if not isinstance(worker_id, str):
            raise KeeperRequestInvalid(f"member_leave needs a worker, got {worker_id!r}")
        self.leave(worker_id)
        return Reply({})


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise KeeperRequestInvalid(f"member record is not JSON: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("worker_id"), str):
        raise KeeperRequestInvalid("member record is not a JSON object with a worker_id")
    return record
