"""A rank's heartbeat: one thread that keeps the rank's member record fresh (its progress,
at most once per ``heartbeat_s`` or at once when woken) through its node keeper, which
publishes its node's records under one lease (``phalanx.runtime.worker.member_relay``),
joins again when the record was lost (the keeper dropped it after a silence, or etcd lost
the rank's own lease), and stays silent for good once the job gave the rank to another
worker (a worker cut off and replaced must not write after the fence)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Protocol

from phalanx.configs.errors import LeaseLost, MembershipUnavailable
from phalanx.runtime.base import KeyValue, MemberRecord
from phalanx.runtime.membership.generation import GENERATION_KEY, GenerationPlan, plan_key

log = logging.getLogger(__name__)


class Reads(Protocol):
    def get(self, key: str) -> KeyValue | None: ...


class MemberChannel(Reads, Protocol):
    """Where the rank's record goes (``phalanx.runtime.worker.member_relay.MemberRelay``:
    its node keeper, or its own lease while the keeper is away)."""

    @property
    def lease_lost(self) -> str: ...
    def join(self, member: MemberRecord, ttl_s: float) -> None: ...
    def update(self, member: MemberRecord, urgent: bool = False) -> None: ...
    def touch(self) -> None: ...


class Heartbeat:
    """``record()`` builds the member record; ``changed()`` returns what, when it differs
    from the last beat, makes a beat write; ``generation()`` the rank's generation.
    ``stop`` ends the thread (shared with the session); ``wake`` beats at once."""

    def __init__(self, membership: MemberChannel, rank: int, worker_id: str,
                 record: Callable[[], MemberRecord], changed: Callable[[], Any],
                 generation: Callable[[], int], heartbeat_s: float, ttl_s: float,
                 stop: threading.Event, wake: threading.Event) -> None:
        self._membership = membership
        self._rank, self._worker_id = rank, worker_id
        self._record, self._changed, self._generation = record, changed, generation
        self._heartbeat_s, self._ttl_s = heartbeat_s, ttl_s
        self._stop, self._wake = stop, wake
        self._thread = threading.Thread(target=self._beat, name="phalanx-heartbeat",
                                        daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=timeout_s)

    def _beat(self) -> None:
        """Refresh the record every heartbeat. etcd unreachable: tried again next beat; our
        lease gone (etcd lost it, or an outage outlived it): joined again under a new lease,
        which puts the record back."""
        last = None
        while not self._stop.is_set():
            woken = self._wake.wait(self._heartbeat_s)
            self._wake.clear()
            current = self._changed()
            if self._membership.lease_lost:     # etcd lost it: the record goes back with it
                last = current if self._rejoin() else None
            if self._stop.is_set():
                continue
            try:
                if current == last:
                    self._membership.touch()    # alive: the keeper holds our record on
                    continue
                self._membership.update(self._record(), urgent=woken)
                last = current
            except LeaseLost as exc:
                log.warning("event=member_lease_lost rank=%d error=%s", self._rank, exc)
                last = current if self._rejoin() else None
            except MembershipUnavailable as exc:
                log.warning("event=heartbeat_failed rank=%d error=%s", self._rank, exc)

    def _rejoin(self) -> bool:
        """Join membership again under a fresh lease; False when etcd did not take it
        (tried again next beat). A worker the job moved past never rejoins."""
        try:
            if self._fenced_out():
                return True
            self._membership.join(self._record(), self._ttl_s)
        except (MembershipUnavailable, LeaseLost) as exc:
            log.warning("event=member_rejoin_failed rank=%d error=%s", self._rank, exc)
            return False
        log.warning("event=member_rejoined rank=%d", self._rank)
        return True

    def _fenced_out(self) -> bool:
        """True (and the heartbeat stops) when a newer generation gave our rank to another
        worker: after a partition heals, a replaced worker must stay silent."""
        generation = self._generation()
        if not is_fenced(self._membership, generation, self._rank, self._worker_id):
            return False
        log.warning("event=member_fenced rank=%d worker=%s generation=%d: replaced while cut "
                    "off; not rejoining", self._rank, self._worker_id, generation)
        self._stop.set()
        return True


def is_fenced(membership: Reads, generation: int, rank: int, worker_id: str) -> bool:
    """Has the job moved to a generation whose plan gives ``rank`` to another worker (this
    one was cut off and replaced)? Reads etcd; raises MembershipUnavailable."""
    current = membership.get(GENERATION_KEY)
    newest = int(current.value) if current is not None else generation
    for later in range(newest, generation, -1):
        kv = membership.get(plan_key(later))
        if kv is None:
            continue
        assignment = GenerationPlan.decode(kv.value).ranks.get(rank)
        return assignment is None or assignment.worker != worker_id
    return False
