"""In-memory fake of the ``Membership`` port: revisions, leases with TTL, CAS and watches.

Several ``InMemoryMembership`` sharing one ``InMemoryStore`` model several processes
against one etcd. Time comes from an injectable clock plus ``advance()``; no threads.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

from phalanx.configs.errors import LeaseLost, MembershipUnavailable
from phalanx.runtime.base import (KEEPERS, MEMBERS, KeyValue, MemberRecord, WatchEvent,
                                  encode_member, member_table)

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    value: bytes
    mod_revision: int
    lease: int


@dataclass
class _Lease:
    ttl_s: float
    deadline: float
    kept_alive: bool = True  # a live owner refreshes it: it does not expire by time


@dataclass
class _Watch:
    prefix: str
    callback: Callable[[WatchEvent], None]
    active: bool = True


class InMemoryStore:
    """The shared state of one fake etcd. Thread-safe.

    Leases expire lazily: at every operation, at ``advance()`` and at ``expire_due()``,
    as etcd's lessor does on its own timer. A lease whose owner keeps it alive never
    expires by time; ``stop_keepalive`` (what a dead process does) starts its TTL.
    Watch callbacks run in the thread that made the change, after the store lock is
    released, in revision order; a callback may call back into the store.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._offset = 0.0
        self._lock = threading.RLock()
        self._revision = 1
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._watches: list[_Watch] = []
        self._pending: deque[tuple[_Watch, WatchEvent]] = deque()
        self._dispatching = False

    # -- time and leases ------------------------------------------------------------------

    def now(self) -> float:
        """The store's time: the clock plus every ``advance()``."""
        return self._clock() + self._offset

    def advance(self, seconds: float) -> list[int]:
        """Move time forward and expire the leases now past their TTL; returns their ids."""
        with self._lock:
            self._offset += seconds
        return self.expire_due()

    def expire_due(self) -> list[int]:
        """Expire every lease past its deadline (and not kept alive); returns their ids."""
        with self._lock:
            now = self.now()
            due = [lid for lid, lease in self._leases.items()
                   if not lease.kept_alive and lease.deadline <= now]
            for lid in due:
                self._drop_lease_locked(lid, reason="expired")
        self._dispatch()
        return due

    def expire_now(self, lease_id: int | None = None) -> list[int]:
        """Force one lease (or every lease) to expire at once, as after a partition."""
        with self._lock:
            ids = list(self._leases) if lease_id is None else [lease_id]
            for lid in ids:
                self._drop_lease_locked(lid, reason="forced")
        self._dispatch()
        return ids

    def grant(self, ttl_s: float) -> int:
        with self._lock:
            lid = next(self._lease_ids)
            self._leases[lid] = _Lease(ttl_s, self.now() + ttl_s)
            return lid

    def lease_alive(self, lease_id: int) -> bool:
        with self._lock:
            self._expire_due_locked()
            return lease_id in self._leases

    def stop_keepalive(self, lease_id: int) -> None:
        """The owner stopped refreshing: the lease expires ``ttl`` from now."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.kept_alive:
                lease.kept_alive = False
                lease.deadline = self.now() + lease.ttl_s

    def revoke(self, lease_id: int) -> None:
        with self._lock:
            self._drop_lease_locked(lease_id, reason="revoked")
        self._dispatch()

    # -- keys -----------------------------------------------------------------------------

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; raises ``LeaseLost`` if ``lease`` is given and gone."""
        with self._lock:
            self._expire_due_locked()
            if lease and lease not in self._leases:
                raise LeaseLost(f"lease {lease:x} is gone; rejoin to write {key!r}")
            self._put_locked(key, value, lease)
            rev = self._revision
        self._dispatch()
        return rev

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            self._expire_due_locked()
            entry = self._data.get(key)
            return None if entry is None else KeyValue(key, entry.value, entry.mod_revision)

    def delete(self, key: str) -> None:
        with self._lock:
            self._expire_due_locked()
            self._delete_locked(key)
        self._dispatch()

    def list_prefix(self, prefix: str) -> list[KeyValue]:
        with self._lock:
            self._expire_due_locked()
            return [KeyValue(k, e.value, e.mod_revision)
                    for k, e in sorted(self._data.items()) if k.startswith(prefix)]

    def compare_and_swap(self, key: str, expected_revision: int, value: bytes,
                         lease: int = 0) -> bool:
        with self._lock:
            self._expire_due_locked()
            entry = self._data.get(key)
            current = 0 if entry is None else entry.mod_revision
            if current != expected_revision:
                return False
            self._put_locked(key, value, lease)
        self._dispatch()
        return True

    def put_if(self, key: str, expected_revision: int, writes: Mapping[str, bytes]) -> bool:
        """Every key of ``writes`` at one new revision, only if ``key``'s mod_revision is
        ``expected_revision`` (0: absent)."""
        if not writes:
            raise ValueError(f"put_if on {key!r} needs at least one key to write")
        with self._lock:
            self._expire_due_locked()
            entry = self._data.get(key)
            if (0 if entry is None else entry.mod_revision) != expected_revision:
                return False
            self._revision += 1
            for name, value in writes.items():
                self._data[name] = _Entry(bytes(value), self._revision, 0)
                self._notify_locked(WatchEvent("put", name, bytes(value)))
        self._dispatch()
        return True

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> Callable[[], None]:
        """Register ``callback`` for changes under ``prefix``; returns an idempotent cancel."""
        watch = _Watch(prefix, callback)
        with self._lock:
            self._watches.append(watch)

        def cancel() -> None:
            with self._lock:
                watch.active = False
                if watch in self._watches:
                    self._watches.remove(watch)
        return cancel

    # -- internals (call with the lock held) -----------------------------------------------

    def _expire_due_locked(self) -> None:
        now = self.now()
        for lid in [lid for lid, lease in self._leases.items()
                    if not lease.kept_alive and lease.deadline <= now]:
            self._drop_lease_locked(lid, reason="expired")

    def _drop_lease_locked(self, lease_id: int, reason: str) -> None:
        if self._leases.pop(lease_id, None) is None:
            return
        keys = [k for k, e in self._data.items() if e.lease == lease_id]
        for key in keys:
            self._delete_locked(key)
        log.info("event=lease_dropped lease=%x reason=%s keys=%d", lease_id, reason, len(keys))

    def _put_locked(self, key: str, value: bytes, lease: int) -> None:
        self._revision += 1
        self._data[key] = _Entry(bytes(value), self._revision, lease)
        self._notify_locked(WatchEvent("put", key, bytes(value)))

    def _delete_locked(self, key: str) -> None:
        if self._data.pop(key, None) is None:
            return
        self._revision += 1
        self._notify_locked(WatchEvent("delete", key, b""))

    def _notify_locked(self, event: WatchEvent) -> None:
        for watch in self._watches:
            if event.key.startswith(watch.prefix):
                self._pending.append((watch, event))

    def _dispatch(self) -> None:
        """Deliver pending events in order; one thread delivers at a time, the others
        leave their events to it (so a callback may write without deadlock)."""
        with self._lock:
            if self._dispatching:
                return
            self._dispatching = True
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    watch, event = self._pending.popleft()
                if watch.active:
                    try:
                        watch.callback(event)
                    except Exception:  # a watcher's bug must not break the writer
                        log.exception("event=watch_callback_failed key=%s", event.key)
        finally:
            with self._lock:
                self._dispatching = False


class InMemoryMembership:
    """One process's view of an ``InMemoryStore``, implementing ``phalanx.runtime.base.Membership``.

    Keys are relative to the job (the store is the job). ``KeyValue.key`` and
    ``WatchEvent.key`` are relative too. After ``close()`` every call raises
    ``MembershipUnavailable``.
    """

    def __init__(self, store: InMemoryStore | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store if store is not None else InMemoryStore(clock)
        self._lock = threading.Lock()
        self._lease = 0
        self._worker_id = ""
        self._cancels: list[Callable[[], None]] = []
        self._closed = False

    def join(self, member: MemberRecord, ttl_s: float) -> None:
        """Write ``members/<worker_id>`` under a fresh lease (whole seconds, at least 1)."""
        self._check_open("join")
        self._drop_own_lease()
        lease = self.store.grant(float(max(1, math.ceil(ttl_s))))
        with self._lock:
            self._lease, self._worker_id = lease, member.worker_id
        self.store.put(MEMBERS + member.worker_id, encode_member(member), lease)

    def update(self, member: MemberRecord) -> None:
        """Rewrite our record under our lease; raises ``LeaseLost`` when it is gone."""
        self.put_leased(MEMBERS + member.worker_id, encode_member(member))

    def put_leased(self, key: str, value: bytes) -> None:
        """Write ``key`` under our lease (it vanishes with us); raises ``LeaseLost``."""
        self._check_open("put_leased")
        with self._lock:
            lease = self._lease
        if not lease:
            raise LeaseLost(f"key {key!r}: this member holds no lease; call join() first")
        self.store.put(key, value, lease)

    def create_leased(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Write ``key`` under a fresh lease of ours only if no one holds it."""
        self._check_open("create_leased")
        self._drop_own_lease()
        lease = self.store.grant(float(max(1, math.ceil(ttl_s))))
        if not self.store.compare_and_swap(key, 0, value, lease):
            self.store.revoke(lease)
            return False
        with self._lock:
            self._lease = lease
        return True

    @property
    def lease_lost(self) -> str:
        """Why our lease is gone; "" while held (or never joined)."""
        lease = self._lease
        return "" if not lease or self.store.lease_alive(lease) else "the lease expired"

    def leave(self) -> None:
        """Revoke our lease (our member key disappears); a no-op when not joined."""
        self._drop_own_lease()

    def members(self) -> dict[str, MemberRecord]:
        self._check_open("members")
        return member_table(self.store.list_prefix(MEMBERS), self.store.list_prefix(KEEPERS))

    def put(self, key: str, value: bytes) -> None:
        self._check_open("put")
        self.store.put(key, value)

    def get(self, key: str) -> KeyValue | None:
        self._check_open("get")
        return self.store.get(key)

    def delete(self, key: str) -> None:
        self._check_open("delete")
        self.store.delete(key)

    def list_prefix(self, prefix: str) -> list[KeyValue]:
        self._check_open("list_prefix")
        return self.store.list_prefix(prefix)

    def compare_and_swap(self, key: str, expected_revision: int, value: bytes) -> bool:
        self._check_open("compare_and_swap")
        return self.store.compare_and_swap(key, expected_revision, value)

    def put_if(self, key: str, expected_revision: int, writes: Mapping[str, bytes]) -> bool:
        self._check_open("put_if")
        return self.store.put_if(key, expected_revision, writes)

    def watch_prefix(self, prefix: str,
                     callback: Callable[[WatchEvent], None]) -> Callable[[], None]:
        self._check_open("watch_prefix")
        cancel = self.store.watch(prefix, callback)
        with self._lock:
            self._cancels.append(cancel)
        return cancel

    def close(self) -> None:
        """Cancel our watches and revoke our lease; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            cancel()
        self._drop_own_lease()

    @property
    def lease_id(self) -> int:
        """Our lease id, 0 when not joined."""
        return self._lease

    def _stop_keepalive(self) -> None:
        """Test hook: behave like a dead process (stop refreshing, do not revoke)."""
        if self._lease:
            self.store.stop_keepalive(self._lease)

    def _drop_own_lease(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, 0
        if lease:
            self.store.revoke(lease)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise MembershipUnavailable(f"in-memory membership is closed; {op} refused")
