"""Publishes what a node keeper holds as one leased etcd key per node (``keepers/<node>``),
refreshed at the heartbeat: the keeper's liveness, the input of the global commit and its
node's ranks' member records (``phalanx.runtime.keeper.members``: one lease and one write per
node per heartbeat). At the same heartbeat it reads the global commit back (``commit``) for
the keeper's workers. etcd load grows with nodes, never with steps x ranks."""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from phalanx.configs.errors import LeaseLost, MembershipUnavailable
from phalanx.runtime.base import KEEPERS, MemberRecord, Membership, is_channel
from phalanx.runtime.commit import COMMIT_KEY, KeeperReport, committed_from
from phalanx.runtime.keeper.members import NodeMembers

log = logging.getLogger(__name__)


def keeper_member(node: str, address: tuple[str, int], pid: int) -> MemberRecord:
    """The keeper's row in the member table (rank -1: not a training rank)."""
    return MemberRecord(worker_id=f"keeper.{node}", rank=-1, node=node,
                        endpoint=f"{address[0]}:{address[1]}", pid=pid,
                        extra={"role": "keeper"})


class KeeperReporter:
    """Owns one thread that writes ``keepers/<node>`` every ``heartbeat_s`` when it changed.

    ``snapshot`` builds the current report and ``on_commit`` takes the committed step read
    back (both called on the reporter thread).
    """

    def __init__(self, membership: Membership, node: str, snapshot: Callable[[], KeeperReport],
                 heartbeat_s: float, ttl_s: float, member: MemberRecord,
                 on_commit: Callable[[int], None] | None = None,
                 fenced: Callable[[], bool] = lambda: False,
                 members: NodeMembers | None = None) -> None:
        self._membership = membership
        self._members = members
        self._fenced = fenced
        self._on_commit = on_commit
        self._node = node
        self._snapshot = snapshot
        self._heartbeat_s = heartbeat_s
        self._ttl_s = ttl_s
        self._member = member
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: bytes = b""

    def start(self) -> "KeeperReporter":
        self._membership.join(self._member, self._ttl_s)
        self._publish()
        self._thread = threading.Thread(target=self._run, name=f"keeper-report-{self._node}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._members is not None:
            self._members.urgent.set()   # its thread waits on this one: wake it now, not
            # at the next heartbeat (each keeper's close waited up to heartbeat_s for it)
        if self._thread is not None:
            self._thread.join(timeout=self._heartbeat_s * 4 + 1)
            self._thread = None
        self._membership.leave()

    def _run(self) -> None:
        while not self._wait():
            if self._fenced():      # replaced while cut off: it must stay silent
                continue
            try:
                if self._membership.lease_lost:    # etcd lost it (an outage outlived it)
                    self._rejoin()
                self._publish()
            except LeaseLost as exc:   # etcd lost our lease: a new one, and the report again
                log.warning("event=keeper_lease_lost node=%s error=%s", self._node, exc)
                self._rejoin()
            except MembershipUnavailable as exc:     # etcd unreachable: next heartbeat
                log.warning("event=keeper_report_failed node=%s error=%s", self._node, exc)
            except Exception as exc:  # thread boundary: report and keep reporting
                log.exception("event=keeper_report_error node=%s error=%r", self._node, exc)

    def _wait(self) -> bool:
        """Until the next heartbeat, or sooner when a rank's beat asked to be published at
        once (its first record, entering a long ``busy`` block); True once stopped."""
        if self._members is None:
            return self._stop.wait(self._heartbeat_s)
        urgent = self._members.urgent
        urgent.wait(self._heartbeat_s)
        urgent.clear()
        return self._stop.is_set()

    def _rejoin(self) -> None:
        self._last = b""
        try:
            self._membership.join(self._member, self._ttl_s)
            log.warning("event=keeper_rejoined node=%s", self._node)
        except (MembershipUnavailable, LeaseLost) as exc:
            log.warning("event=keeper_rejoin_failed node=%s error=%s", self._node, exc)

    def _publish(self) -> None:
        report = self._snapshot()
        versions: dict[str, int] = {}
        if self._members is not None:
            rows, versions = self._members.current()
            report = dataclasses.replace(report, members=rows)
        data = report.to_json()
        # with its ranks' records the report is the node's heartbeat: written every beat,
        # so its revision moving tells the launcher the records are current (a record that
        # stands still on a report that moves is a rank that stands still)
        if data != self._last or self._members is not None:
            self._membership.put_leased(KEEPERS + self._node, data)
            self._last = data
        if self._members is not None:
            self._members.published(versions)
        if self._on_commit is not None:
            self._on_commit(read_commit_point(self._membership))


def read_commit_point(membership: Membership) -> int:
    """The job's committed step as ``commit`` holds it now (-1: none); one etcd read.
    Raises MembershipUnavailable."""
    commit = membership.get(COMMIT_KEY)
    return committed_from(commit.value if commit else None)


def report_from_keeper(node: str, address: tuple[str, int], holdings: dict[int, dict[str, Any]],
                       stats: dict[str, int], generation: int) -> KeeperReport:
    # a rank's per-rank snapshot channel is the keeper's business (heals read it directly)
    holdings = {rank: info for rank, info in holdings.items() if not is_channel(rank)}
    return KeeperReport(
        node=node, address=address,
        local={rank: tuple(info.get("local", ())) for rank, info in holdings.items()
               if info.get("local")},
        replicas={rank: tuple(info.get("replica", ())) for rank, info in holdings.items()
                  if info.get("replica")},
        bytes_held=int(stats.get("resident_bytes", 0)),
        bytes_shared=int(stats.get("shared_bytes", 0)),
        generation=generation)
