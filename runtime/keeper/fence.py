"""A keeper's write fence: it writes shared, durable state (tier checkpoints, its etcd
report) only while it can confirm through etcd that the job's generation is one the
coordinator gave it. A keeper cut off from etcd pauses; one the job moved past (its node
declared lost during a partition) stops writing for good."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.base import Membership
from phalanx.runtime.membership.generation import GENERATION_KEY

log = logging.getLogger(__name__)
CHECK_EVERY_S = 0.5


class KeeperFence:
    """Thread-safe. ``given(g)`` when the coordinator hands the keeper generation ``g``;
    ``may_write()`` before every durable write. A generation newer than the one given,
    for longer than ``grace_s`` (a live keeper gets the new one within a recovery), fences
    the keeper permanently."""

    def __init__(self, membership: Membership, node: str, grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._membership = membership
        self._node = node
        self._grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._given = 0
        self._ok = True
        self._next_check = 0.0
        self._behind_since: float | None = None
        self.fenced = False

    def given(self, generation: int) -> None:
        with self._lock:
            self._given = max(self._given, generation)
            self._next_check = 0.0

    def may_write(self) -> bool:
        with self._lock:
            if self.fenced:
                return False
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + CHECK_EVERY_S
                self._ok = self._confirm(now)
            return self._ok

    def _confirm(self, now: float) -> bool:
        try:
            kv = self._membership.get(GENERATION_KEY)
        except MembershipUnavailable:    # cannot confirm: write nothing until we can
            return False
        current = int(kv.value) if kv is not None else 0
        if current <= self._given:
            self._behind_since = None
            return True
        if self._behind_since is None:
            self._behind_since = now
        if now - self._behind_since >= self._grace_s:
            self.fenced = True
            log.warning("event=keeper_fenced node=%s generation=%d given=%d: the job moved on "
                        "without this keeper; it writes nothing more", self._node, current,
                        self._given)
        return False
