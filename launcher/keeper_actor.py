"""The node keeper as a Ray actor pinned to its node: it owns the node's snapshot memory,
persists committed steps to the tiers, and reports what it holds to etcd. It lives as long
as the node, so a worker crash loses nothing."""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from typing import Any

import ray

from phalanx.launcher.run_files import list_run_files, read_run_file
from phalanx.configs.loader import load_config_text
from phalanx.configs.errors import MembershipUnavailable
from phalanx.runtime.base import per_rank_channel
from phalanx.runtime.logs import DEFAULT_FORMAT, bind_fields, configure_logging
from phalanx.runtime.node import node_keeper
from phalanx.runtime.keeper.fence import KeeperFence
from phalanx.runtime.keeper.members import NodeMembers
from phalanx.runtime.keeper.memory_plan import MemoryPlan
from phalanx.runtime.keeper.reporter import (KeeperReporter, keeper_member, read_commit_point,
                                             report_from_keeper)
from phalanx.runtime.membership.etcd import (EtcdMembership, client_fields, client_options,
                                             job_prefix)
from phalanx.runtime.tiers.persister import JOIN_TIMEOUT_S, TierPersister
from phalanx.runtime.replication.pusher import Replicator
from phalanx.runtime.tiers.config import tier_specs

log = logging.getLogger(__name__)
EVENTS_KEPT = 200
PERSIST_SETTLE_S = 5.0   # at close, how long a marker the final commit point allows waits for other nodes
# the longest settle_tiers() takes: the settle above, then the persister's thread joined
SETTLE_TIERS_S = PERSIST_SETTLE_S + JOIN_TIMEOUT_S


def keeper_bind_host(configured: str) -> str:
    """``replication.bind_host`` resolved on the keeper's node: ``auto`` is the address Ray
    knows this node by (what other hosts reach it at), anything else is used as given."""
    return ray.util.get_node_ip_address() if configured == "auto" else configured


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class KeeperActor:
    """Called from the launcher's thread through Ray with plain values only."""

    def __init__(self, node: str, config_yaml: str, secret_hex: str, etcd_endpoints: list[str],
                 run_dir: str, local_ranks: list[int], log_format: str = DEFAULT_FORMAT) -> None:
        configure_logging(log_format, logging.INFO)      # the launcher's --log-format
        bind_fields(node=node)
        cfg = load_config_text(config_yaml, source="keeper config")
        self._node = node
        self._run_dir = run_dir
        self._generation = 0
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._lock = threading.Lock()
        self._fence = 0
        secret = bytes.fromhex(secret_hex)
        self._members = NodeMembers()     # the node's ranks' records, under our one lease
        self._keeper = node_keeper(node, cfg.job.name, secret, members=self._members,
                                   shm_dir=cfg.snapshot.shm_dir, slots=cfg.snapshot.slots,
                                   bind_host=keeper_bind_host(cfg.replication.bind_host),
                                   generation_check=lambda generation: generation >= self._fence,
                                   timeout_s=cfg.replication.timeout_s,
                                   plan=MemoryPlan.from_config(cfg),
                                   allow_unprotected=cfg.snapshot.allow_unprotected,
                                   on_event=self._on_event).start()
        self._replicator = None
        if cfg.replication.enabled and cfg.replication.factor > 0:
            self._replicator = Replicator(
                self._keeper, node, secret=secret, job=cfg.job.name,
                timeout_s=cfg.replication.timeout_s,
                chunk_bytes=int(cfg.replication.chunk_mb * 2**20),
                on_event=self._on_replica_event).start()
        self._membership = EtcdMembership(etcd_endpoints, job_prefix(cfg.etcd.prefix, cfg.job.name),
                                          **client_options(**client_fields(cfg.etcd)))
        self._membership.connect(retry_for_s=60)
        self._write_fence = KeeperFence(self._membership, node, 2 * cfg.etcd.lease_ttl_s)
        self._reporter = KeeperReporter(
            self._membership, node, self._report, cfg.etcd.heartbeat_s, cfg.etcd.lease_ttl_s,
            keeper_member(node, self._keeper.address, os.getpid()),
            on_commit=self._keeper.note_committed,
            fenced=lambda: not self._write_fence.may_write() and self._write_fence.fenced,
            members=self._members).start()
        tiers = tier_specs(cfg, run_dir)
        self._persister = None
        if tiers and local_ranks:
            # a tier commits only steps the job committed (f+1 copies, digests agreed)
            self._persister = TierPersister(self._keeper, tiers, list(range(cfg.job.world_size)),
                                            local_ranks, on_event=self._on_event,
                                            may_write=self._write_fence.may_write,
                                            committed=self._keeper.committed_step,
                                            read_committed=self._read_commit,
                                            settle_s=PERSIST_SETTLE_S).start()

    def set_targets(self, generation: int, local_ranks: list[int],
                    holders: dict[int, list[str]], addresses: dict[str, list]) -> None:
        """A new generation: fence older writers, replicate ``local_ranks`` to their
        holders, persist the ranks now on this node."""
        self._fence = self._generation = generation
        self._write_fence.given(generation)
        persisted = list(local_ranks)
        # each rank's per-rank snapshots live, and are replicated, like its full ones
        holders = {**holders, **{per_rank_channel(int(r)): nodes for r, nodes in holders.items()}}
        local_ranks = persisted + [per_rank_channel(r) for r in persisted]
        if generation > 0:
            self._keeper.plan_proven()
        self._keeper.retarget(local_ranks, [int(r) for r, nodes in holders.items()
                                            if self._node in nodes])
        if self._replicator is not None:
            mine = {int(r): list(holders.get(r, [])) for r in local_ranks if holders.get(r)}
            self._replicator.set_targets(generation, mine,
                                         {n: (str(a[0]), int(a[1])) for n, a in addresses.items()})
        if self._persister is not None:
            self._persister.set_local_ranks(persisted)

    def replication_stats(self) -> dict[str, Any]:
        return {} if self._replicator is None else dict(self._replicator.stats())

    def _read_commit(self) -> int:
        """The ``commit`` key read now (the persister thread, while a marker waits for
        it), handed to the keeper too; etcd unreachable: the keeper's last view."""
        try:
            self._keeper.note_committed(read_commit_point(self._membership))
        except MembershipUnavailable as exc:
            log.info("event=commit_read_failed node=%s error=%s", self._node, exc)
        return self._keeper.committed_step()

    def _on_replica_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "replica_failed":
            self._on_event(event)

    def _report(self) -> Any:
        return report_from_keeper(self._node, self._keeper.address, self._keeper.holdings(),
                                  self._keeper.stats(), self._generation)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append({**event, "node": self._node})

    def address(self) -> tuple[str, int]:
        return self._keeper.address

    def pid(self) -> int:
        return os.getpid()

    def holdings(self) -> dict[int, dict[str, Any]]:
        return self._keeper.holdings()

    def stats(self) -> dict[str, int]:
        return self._keeper.stats()

    def snapshot_files(self, rank: int) -> list[dict[str, Any]]:
        return self._keeper.snapshot_files(rank)

    def run_files(self) -> dict[str, int]:
        """The run's log files on this node and their sizes (``launcher.run_files``)."""
        return list_run_files(self._run_dir)

    def read_run_file(self, relative: str, offset: int, limit: int) -> bytes:
        return read_run_file(self._run_dir, relative, offset, limit)

    def settle_tiers(self) -> None:
        """At a finished job's end, before its last events are drained: the persister writes
        the markers the final commit point allows (waiting up to ``PERSIST_SETTLE_S`` for
        other nodes) and stops, so their tier events reach the job's event log (written at
        ``close``, after the log was closed, they were lost)."""
        if self._persister is not None:
            self._persister.close()

    def events(self) -> list[dict[str, Any]]:
        """Tier and replication events since the last call (drained)."""
        with self._lock:
            drained = list(self._events)
            self._events.clear()
        return json.loads(json.dumps(drained))

    def close(self) -> None:
        if self._replicator is not None:
            self._replicator.close()
        if self._persister is not None:
            self._persister.close()
        self._reporter.close()
        self._membership.close()
        self._keeper.close()
