"""A rank's member record, relayed through its node keeper: the keeper publishes the
records of all its ranks under its one etcd lease at its one heartbeat
(``phalanx.runtime.keeper.members``), so etcd's load grows with nodes, not ranks.

While the keeper cannot be reached (killed and being replaced, or none on this node) the
rank holds its own lease and writes its own ``members/<worker>`` key, as every rank did
before; once a keeper answers again (found under ``keepers/<node>``) the record moves back
to it, and the rank's own lease is revoked only after the keeper has published the record,
so the launcher never sees the rank vanish in between.

Offers what ``phalanx.runtime.worker.heartbeat.Heartbeat`` needs of a membership: ``join``,
``update``, ``touch``, ``lease_lost``, ``leave`` and ``get``. A keepalive thread beats when
nothing else did for a third of the TTL, so the record outlives the heartbeat while the rank
closes, as its own lease would.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable

from phalanx.configs.errors import LeaseLost, PhalanxError
from phalanx.runtime.base import KeyValue, MemberRecord, Membership, encode_member
from phalanx.runtime.keeper.wire import KeeperClient

log = logging.getLogger(__name__)
RETRY_S = 0.5        # how often a rank on its own lease looks for its keeper again


class MemberRelay:
    """Thread-safe (one lock): the rank's heartbeat thread, its own keepalive thread, and the
    training thread's final ``update`` and ``close``. ``open_keeper()`` returns a client of
    the node's keeper as etcd names it now, or None (none known, or it does not answer);
    ``membership`` is the rank's etcd client, which holds the rank's own lease while the
    keeper is away."""

    def __init__(self, membership: Membership, worker_id: str,
                 open_keeper: Callable[[], KeeperClient | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._membership = membership
        self._worker_id = worker_id
        self._open_keeper = open_keeper
        self._clock = clock
        self._lock = threading.Lock()
        self._keeper: KeeperClient | None = None
        self._own_lease = False          # the record lives under the rank's own lease
        self._moving = False             # handed to the keeper, own lease kept until published
        self._lost = ""                  # the keeper forgot us (silent past our TTL)
        self._record: MemberRecord | None = None
        self._ttl_s = 0.0
        self._next_try = 0.0
        self._record_relayed = False     # a keeper has held our record (its loss is news)
        self._sent_at = 0.0              # clock time of the last beat the keeper answered
        self._keepalive: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def via_keeper(self) -> bool:
        """The record is published by the node keeper (not under the rank's own lease)."""
        return self._keeper is not None and not self._own_lease and not self._moving

    @property
    def lease_lost(self) -> str:
        """Why the record is gone: the keeper dropped it (we were silent past our TTL), or
        etcd lost our own lease; "" while it is held."""
        return self._membership.lease_lost if self._own_lease else self._lost

    def join(self, member: MemberRecord, ttl_s: float) -> None:
        """Register the record with the keeper (published at once), or under our own lease
        when no keeper answers. The first join starts the keepalive."""
        with self._lock:
            self._record, self._ttl_s, self._lost = member, ttl_s, ""
            if self._keepalive is None:
                self._keepalive = threading.Thread(target=self._keep_alive, daemon=True,
                                                   name=f"member-keepalive-{self._worker_id}")
                self._keepalive.start()
            if self._keeper is None:
                self._keeper = self._open_keeper()
            if self._keeper is not None and self._send(member, join=True):
                return
            self._fall_back(member, "no keeper answers")

    def update(self, member: MemberRecord, urgent: bool = False) -> None:
        """The record changed; raises ``LeaseLost`` when the keeper forgot us (or etcd lost
        our own lease): ``join`` again."""
        with self._lock:
            self._record = member
            if self._own_lease:
                self._membership.update(member)
                self._try_keeper(member)
                return
            if self._keeper is None or not self._send(member, urgent=urgent):
                if self._lost:
                    raise LeaseLost(f"keeper dropped member {self._worker_id}: {self._lost}")
                self._fall_back(member, "keeper unreachable")

    def touch(self) -> None:
        """Nothing changed: tell the keeper we live (our own lease is kept alive by etcd's
        client), and move back to the keeper when one answers again."""
        with self._lock:
            record = self._record
            if record is None:
                return
            if self._own_lease or self._moving:
                self._try_keeper(record)
                return
            if self._keeper is not None and self._send(None):
                return
            if not self._lost:
                self._fall_back(record, "keeper unreachable")

    def leave(self) -> None:
        """Leave on purpose (the rank finished or is closing)."""
        with self._lock:
            if self._keeper is not None:
                with contextlib.suppress(PhalanxError):    # it drops us at our TTL anyway
                    self._keeper.member_leave(self._worker_id)
            if self._own_lease or self._moving:
                self._membership.leave()
                self._own_lease = self._moving = False

    def close(self) -> None:
        self._closing.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=5.0)
        self.leave()
        with self._lock:
            if self._keeper is not None:
                self._keeper.close()
                self._keeper = None

    def get(self, key: str) -> KeyValue | None:
        return self._membership.get(key)

    def _keep_alive(self) -> None:
        """Beat at a third of the TTL whenever nothing else did: the record must outlive
        the rank's heartbeat thread while the rank closes (a group teardown, the last
        snapshot), as an etcd lease is kept alive by its client until it is revoked. A
        frozen process beats no more: its record lapses."""
        while not self._closing.wait(max(0.1, self._ttl_s / 3)):
            if self._clock() - self._sent_at >= self._ttl_s / 3:
                try:
                    self.touch()
                except PhalanxError as exc:     # etcd unreachable for our own lease
                    log.warning("event=member_keepalive_failed worker=%s error=%s",
                                self._worker_id, exc)

    # -- the keeper and the rank's own lease --------------------------------------------

    def _send(self, record: MemberRecord | None, join: bool = False,
              urgent: bool = False) -> bool:
        """One beat to the keeper; False (and the client dropped) when it is unreachable
        or has forgotten us (``_lost`` set)."""
        assert self._keeper is not None
        try:
            answer = self._keeper.member_beat(
                self._worker_id, None if record is None else encode_member(record),
                self._ttl_s, join=join, urgent=urgent or join)
        except PhalanxError as exc:     # unreachable, or a keeper that refuses the op
            log.warning("event=member_keeper_lost worker=%s error=%s", self._worker_id, exc)
            self._drop_keeper()
            return False
        self._sent_at = self._clock()
        if not answer["known"]:
            self._lost = "silent past its TTL"
            return False
        self._record_relayed = True
        if self._moving and answer["published"]:
            self._moving = False
            self._membership.leave()        # the keeper's report holds us now
            log.info("event=member_relayed worker=%s", self._worker_id)
        return True

    def _fall_back(self, member: MemberRecord, why: str) -> None:
        """Hold our own lease (as a rank with no keeper does) until a keeper answers."""
        self._membership.join(member, self._ttl_s)
        self._own_lease, self._moving = True, False
        self._next_try = self._clock() + RETRY_S
        log.log(logging.WARNING if self._record_relayed else logging.INFO,
                "event=member_own_lease worker=%s reason=%s", self._worker_id, why)

    def _try_keeper(self, member: MemberRecord) -> None:
        """On our own lease: at most every ``RETRY_S``, hand the record to the node's keeper
        (as etcd names it now); our lease is revoked once the keeper published it."""
        if self._moving:     # a bare beat: a new record would be a version not yet published
            if not self._send(None):
                self._moving, self._own_lease = False, True     # still ours: stay on it
            return
        now = self._clock()
        if now < self._next_try:
            return
        self._next_try = now + RETRY_S
        if self._keeper is None:
            self._keeper = self._open_keeper()
        if self._keeper is None:
            return
        self._moving, self._own_lease, self._lost = True, False, ""
        if not self._send(member, join=True):
            self._moving, self._own_lease = False, True

    def _drop_keeper(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
