"""A worker's link to its node's keeper that outlives the keeper: a snapshot the keeper can
no longer take is skipped (training goes on), and the link moves to the keeper the
launcher started in its place, which it finds under ``keepers/<node>`` in etcd. A keeper
that refuses the job's snapshots for want of shared memory (``MemoryPlanExceeded``) stops
the worker, unless the job accepted degraded protection (then the refusal is skipped)."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Mapping

from phalanx.configs.errors import ConfigError, MembershipUnavailable, PeerUnreachable, PhalanxError
from phalanx.runtime.base import Membership
from phalanx.runtime.commit import KeeperReport
from phalanx.runtime.keeper.memory_plan import MemoryPlanExceeded
from phalanx.runtime.keeper.reporter import KEEPERS
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.snapshotter import Snapshotter

log = logging.getLogger(__name__)
RETRY_S = 0.25          # how often a worker whose keeper is gone looks for its successor
PROBE_TIMEOUT_S = 2.0   # a successor must answer a ping within this to be used

Open = Callable[[str, int, float | None], KeeperClient]   # host, port, timeout (None: usual)


def keeper_address(membership: Membership | None, node: str) -> tuple[str, int] | None:
    """Where ``node``'s keeper listens by its last report in etcd; None when there is no
    report, it cannot be read, or etcd is unreachable."""
    if membership is None:
        return None
    try:
        found = membership.get(KEEPERS + node)
        return None if found is None else KeeperReport.from_json(found.value).address
    except (MembershipUnavailable, ValueError, KeyError, IndexError) as exc:
        log.info("event=keeper_address_unknown node=%s error=%s", node, exc)
        return None


def no_room(exc: ConfigError) -> bool:
    """Whether ``exc`` says the keeper's tmpfs is full right now (a snapshot is skipped and
    training goes on), not that the job's snapshots can never fit (``MemoryPlanExceeded``,
    fatal unless ``snapshot.allow_unprotected``)."""
    return exc.key == "snapshot.shm_dir" and not isinstance(exc, MemoryPlanExceeded)


class KeeperLink:
    """Owned by the Session; used from the training thread. Holds the ``KeeperClient`` in
    use (``client``). Once a call finds the keeper unreachable, the link is down: captures
    are skipped (``Snapshotter.skip``) and, at most every ``retry_s``, ``lookup()`` is asked
    for the keeper's address; the first address that answers a ping (with the current
    generation, through ``open``) becomes the client, and snapshots resume there."""

    def __init__(self, client: KeeperClient, open_client: Open,
                 lookup: Callable[[], tuple[str, int] | None], retry_s: float = RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._open = open_client
        self._lookup = lookup
        self._retry_s = retry_s
        self._clock = clock
        self._down_since: float | None = None
        self._next_try = 0.0
        self.skipped = 0
        self._full_since: float | None = None     # shared memory full since (no slots)
        self.reconnects = 0

    @property
    def client(self) -> KeeperClient:
        return self._client

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def capture(self, snapshotter: Snapshotter, step: int, objects: Mapping[str, Any]) -> bool:
        """Snapshot ``step`` through the keeper; False when skipped because it is gone.
        Raises what ``Snapshotter.capture`` raises other than ``PeerUnreachable``."""
        if self.down and not self._reconnect(snapshotter):
            self._skip(snapshotter, step)
            return False
        try:
            snapshotter.capture(step, objects)
        except PeerUnreachable as exc:
            self._lost(exc)
            self._skip(snapshotter, step)
            return False
        except ConfigError as exc:
            # the job's snapshots do not fit and degraded protection was not accepted
            # (snapshot.allow_unprotected): never train on without a safety net unknowingly
            if not no_room(exc):
                raise
            self._no_room(snapshotter, step, exc)    # accepted: shared memory is full, train on
            return False
        if self._full_since is not None:
            log.warning("event=snapshot_room_back rank_step=%d skipped=%d", step, self.skipped)
            self._full_since = None
        return True

    def _no_room(self, snapshotter: Snapshotter, step: int, exc: ConfigError) -> None:
        """The keeper has no shared memory left for this rank's slots: the step is not
        snapshotted (durability waits, training does not) and the next one tries again."""
        if self._full_since is None:
            self._full_since = self._clock()
            log.warning("event=snapshot_no_room step=%d error=%s", step, exc)
        self._skip(snapshotter, step)

    def drop(self, rank: int, above_step: int | None = None) -> None:
        """Drop ``rank``'s snapshots above ``above_step`` (a rollback); nothing to drop on a
        keeper that is gone (its successor starts empty)."""
        if self.down:
            return
        try:
            self._client.drop(rank, above_step=above_step)
        except PeerUnreachable as exc:
            self._lost(exc)

    def close(self) -> None:
        self._client.close()

    def _skip(self, snapshotter: Snapshotter, step: int) -> None:
        snapshotter.skip(step)
        self.skipped += 1

    def _lost(self, exc: PeerUnreachable) -> None:
        now = self._clock()
        if self._down_since is None:
            self._down_since = now
            log.warning("event=keeper_unreachable keeper=%s error=%s", self._client.address, exc)
        self._next_try = now + self._retry_s
        self._client.close()

    def _reconnect(self, snapshotter: Snapshotter) -> bool:
        """Use the keeper etcd names now if it answers; False when none does (yet)."""
        now = self._clock()
        if now < self._next_try:
            return False
        self._next_try = now + self._retry_s
        address = self._lookup()
        if address is None:
            return False
        host, port = address
        probe = self._open(host, port, PROBE_TIMEOUT_S)
        try:
            probe.ping()
        except PhalanxError:        # still the dead keeper's address, or not serving yet
            return False
        finally:
            with contextlib.suppress(Exception):
                probe.close()
        client = self._open(host, port, None)
        snapshotter.use_client(client)
        self._client.close()
        self._client = client
        down_s = now - (self._down_since or now)
        self._down_since = None
        self.reconnects += 1
        log.warning("event=keeper_reconnected keeper=%s:%d down_s=%.3f skipped=%d", host, port,
                    down_s, self.skipped)
        return True
