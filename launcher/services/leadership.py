"""Who coordinates a job: one launcher holds the job's ``coordinator`` key under its own
etcd lease; a standby launcher (``phalanx launch --standby``) waits for that key to vanish
(the leader died, or etcd stopped hearing from it for a lease TTL) and takes it. The leader
also publishes what a successor needs to carry on (``coordinator/state``: run directory,
which actor runs which rank, keepers, spares, generation), refreshed after every change.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from phalanx.configs.errors import MembershipUnavailable, PhalanxError
from phalanx.runtime.membership.etcd import EtcdMembership

log = logging.getLogger(__name__)
COORDINATOR_KEY = "coordinator"
STATE_KEY = "coordinator-state"
STATE_VERSION = 1


class LeadershipLost(PhalanxError):
    """This launcher's coordinator lease expired: another launcher may lead now, so this one
    stops without touching the job's workers, keepers or spares."""


class FenceLost(LeadershipLost):
    """The generation moved under this coordinator (its fencing transaction found another
    coordinator's generation): another launcher leads the job now, so this one stops like
    after a lost lease, leaving the job's workers, keepers and spares to it."""


class StandbyError(PhalanxError):
    """A standby launcher cannot take over the job (no state published, config mismatch)."""


def identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": round(time.time(), 3)}


class Leadership:
    """Owned by the launcher's main thread. Its own etcd connection and lease, so the lease
    is the launcher's liveness and nothing else. ``step_down_when_silent``: with a standby
    that may take over, a lease etcd did not confirm for a whole TTL (etcd unreachable from
    here) counts as lost too; without one, etcd's word alone (an outage is ridden out)."""

    def __init__(self, membership: EtcdMembership, ttl_s: float,
                 step_down_when_silent: bool = False) -> None:
        self._membership = membership
        self._ttl_s = ttl_s
        self._step_down_when_silent = step_down_when_silent
        self.held = False

    def try_acquire(self) -> bool:
        """Take the coordinator key if no launcher holds it; True when this one leads now."""
        self.held = self._membership.create_leased(COORDINATOR_KEY,
                                                   json.dumps(identity()).encode(), self._ttl_s)
        return self.held

    def holder(self) -> dict[str, Any] | None:
        found = self._membership.get(COORDINATOR_KEY)
        return None if found is None else json.loads(found.value)

    def wait(self, poll_s: float = 0.1, on_waiting: Callable[[dict[str, Any]], None] = lambda h: None,
             deadline_s: float | None = None) -> None:
        """Block until this launcher leads (a standby's wait); ``on_waiting(holder)`` is
        called whenever the holder changes. Raises ``StandbyError`` past ``deadline_s``."""
        started, seen = time.monotonic(), None
        while not self.try_acquire():
            holder = self.holder()
            if holder is not None and holder != seen:
                seen = holder
                on_waiting(holder)
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                raise StandbyError(f"no leader left within {deadline_s} s")
            time.sleep(poll_s)

    def check(self) -> None:
        """Raise ``LeadershipLost`` once the lease is gone (checked every poll)."""
        lost = self._membership.lease_lost
        silent = getattr(self._membership, "lease_silent_s", 0.0)
        if self._step_down_when_silent and silent > self._ttl_s:
            lost = lost or f"etcd did not confirm it for {silent:.1f} s"
        if self.held and lost:
            self.held = False
            raise LeadershipLost(f"the coordinator lease was lost ({lost}): another launcher "
                                 "may lead this job now; this one stops and leaves the "
                                 "job's processes to it")

    def release(self) -> None:
        """Give the lease back; etcd unreachable: it then ends by its TTL."""
        if self.held:
            self.held = False
            try:
                self._membership.leave()
            except MembershipUnavailable as exc:
                log.warning("event=coordinator_lease_not_revoked error=%s", exc)


@dataclass
class JobState:
    """What a standby needs to take over, as published by the leader (JSON in etcd).

    ``slots``: rank → {worker_id, node, actor}; ``keepers``: node → {actor, host, port};
    ``spares``: spare id → {node, actor}; actor values are Ray actor names in the job's
    namespace."""

    run_dir: str
    generation: int
    slots: dict[int, dict[str, Any]]
    keepers: dict[int, dict[str, Any]]
    spares: dict[str, dict[str, Any]]
    spare_serial: int
    live_nodes: list[int]
    recoveries: int
    holders: dict[int, list[str]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    version: int = STATE_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "JobState":
        raw = json.loads(data)
        if raw.get("version") != STATE_VERSION:
            raise StandbyError(f"coordinator state version {raw.get('version')!r} is not "
                               f"{STATE_VERSION}: run the same phalanx version as the leader")
        return cls(run_dir=raw["run_dir"], generation=int(raw["generation"]),
                   slots={int(r): v for r, v in raw["slots"].items()},
                   keepers={int(n): v for n, v in raw["keepers"].items()},
                   spares=dict(raw["spares"]), spare_serial=int(raw["spare_serial"]),
                   live_nodes=[int(n) for n in raw["live_nodes"]],
                   recoveries=int(raw["recoveries"]),
                   holders={int(r): list(h) for r, h in raw.get("holders", {}).items()},
                   history=list(raw.get("history", [])))


def publish_state(membership: EtcdMembership, state: JobState) -> None:
    membership.put(STATE_KEY, state.to_json())


def read_state(membership: EtcdMembership) -> JobState:
    found = membership.get(STATE_KEY)
    if found is None:
        raise StandbyError("the leader published no coordinator state (it died while "
                           "starting the job): start the job again")
    return JobState.from_json(found.value)
