"""The job's shared-memory plan: how many bytes of snapshots (every rank's slots, every
replica a node keeps) one tmpfs must hold for a given snapshot size per rank, and the one
check of it against the room there is. The launcher runs it at start-up with
``snapshot.rank_size_mb``; each keeper runs it at a rank's first snapshot with the size
measured then, and refuses (``MemoryPlanExceeded``) unless ``snapshot.allow_unprotected``."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.keeper.shm import _gib, allocated_bytes, capacity_shortfall, memory_plan
from phalanx.runtime.transport.frames import register_remote_error

KEY = "snapshot.shm_dir"
REPLICA_KEEP = 2    # replica steps a keeper keeps per rank (the Keeper's default)
# A keeper's file after ``phalanx-<job>-``: ``<node>-r<rank>-v<layout>-s<slot>`` or ``<node>-x<n>``
_JOB_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*-(r\d+-v\d+-s\d+|x\d+)$")


@register_remote_error
class MemoryPlanExceeded(ConfigError):
    """The job's snapshots (slots + replicas, at the size measured at the first snapshot)
    do not fit the shared memory there is, and ``snapshot.allow_unprotected`` is off: the
    job would train with no safety net. Fatal: a replacement would fail the same way."""


@dataclass(frozen=True)
class MemoryPlan:
    """What one tmpfs holds: ``shared_nodes`` keepers (all virtual nodes of an embedded
    Ray share this machine's; a node of a joined cluster has its own), each with
    ``slots`` buffers per local rank and ``replicas_held`` (+1 receiving) buffers for each
    of the ``copies`` x local ranks it holds replicas of."""

    world_size: int
    nodes: int
    slots: int
    copies: int
    shared_nodes: int
    replicas_held: int = REPLICA_KEEP

    @classmethod
    def from_config(cls, cfg: PhalanxConfig) -> "MemoryPlan":
        return cls(cfg.job.world_size, cfg.job.nodes, cfg.snapshot.slots,
                   cfg.replication.copies, 1 if cfg.ray.address else cfg.job.nodes)

    @property
    def ranks_on_node(self) -> int:
        return -(-self.world_size // self.nodes)

    def node_bytes(self, per_rank_bytes: int) -> int:
        """Bytes one node's keeper needs at most (``shm.memory_plan``)."""
        return memory_plan(per_rank_bytes, self.ranks_on_node, self.slots, self.copies,
                           self.replicas_held)

    def tmpfs_bytes(self, per_rank_bytes: int) -> int:
        """Bytes the tmpfs these keepers share needs at most."""
        return self.shared_nodes * self.node_bytes(per_rank_bytes)

    def describe(self, per_rank_bytes: int) -> str:
        replicas = self.replicas_held + 1 if self.replicas_held else 0
        return (f"{self.shared_nodes} node(s) x ({self.ranks_on_node} rank(s) x {self.slots} "
                f"slots + {self.ranks_on_node * self.copies} replicated rank(s) x {replicas} "
                f"buffers) x {per_rank_bytes} bytes = {self.tmpfs_bytes(per_rank_bytes)} bytes "
                f"({_gib(self.tmpfs_bytes(per_rank_bytes))}; the worst case: a replica shares "
                f"the replicated state a node's own ranks hold, one copy per node, until a "
                f"claim makes it copy the bytes in)")


def job_bytes_held(shm_dir: str, job: str) -> int:
    """Bytes the job's keepers already hold in ``shm_dir`` (allocated blocks of every
    ``phalanx-<job>-<node>-...`` file): part of the plan, already out of the free room."""
    prefix = f"phalanx-{job}-"
    held = 0
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(prefix) and _JOB_FILE_RE.match(name[len(prefix):]):
            held += allocated_bytes(os.path.join(shm_dir, name))   # (0: unlinked as we looked)
    return held


def plan_shortfall(plan: MemoryPlan, per_rank_bytes: int, shm_dir: str,
                   held: int = 0) -> str | None:
    """Why ``shm_dir`` cannot hold ``plan`` at ``per_rank_bytes`` per rank (the numbers),
    or None when it can. ``held``: bytes of the plan already allocated there."""
    more = max(0, plan.tmpfs_bytes(per_rank_bytes) - held)
    limits = capacity_shortfall(more, shm_dir)
    if limits is None:
        return None
    already = f", {held} bytes of it already allocated" if held else ""
    return f"snapshots need {plan.describe(per_rank_bytes)}{already}, but {limits}"


def fix_hint(shm_dir: str) -> str:
    """What to do when the plan does not fit ``shm_dir``."""
    return (f"give {shm_dir} more room (Docker: --shm-size=...; a tmpfs: mount -o "
            f"remount,size=...), point snapshot.shm_dir at a larger tmpfs, lower "
            f"snapshot.slots or replication.factor, snapshot less state, or set "
            f"snapshot.allow_unprotected: true to train on with degraded protection")


def check_plan(plan: MemoryPlan, per_rank_bytes: int, shm_dir: str, *, held: int = 0,
               measured: str = "") -> None:
    """Raise ``MemoryPlanExceeded`` (key ``snapshot.shm_dir``) naming the sizes and the fix
    when ``shm_dir`` cannot hold ``plan``; ``measured`` says where the size came from."""
    if not os.path.isdir(shm_dir):
        raise ConfigError(KEY, f"{shm_dir} is not a directory",
                          "point snapshot.shm_dir at a tmpfs such as /dev/shm")
    short = plan_shortfall(plan, per_rank_bytes, shm_dir, held)
    if short is not None:
        raise MemoryPlanExceeded(KEY, (measured + ": " if measured else "") + short,
                                 fix_hint(shm_dir))


def check_config_plan(cfg: PhalanxConfig) -> None:
    """The launcher's start-up check: ``snapshot.rank_size_mb`` (when set) against the plan."""
    if not cfg.snapshot.enabled or cfg.snapshot.rank_size_mb <= 0:
        return
    check_plan(MemoryPlan.from_config(cfg), int(cfg.snapshot.rank_size_mb * 2**20),
               cfg.snapshot.shm_dir, measured=f"snapshot.rank_size_mb={cfg.snapshot.rank_size_mb:g}")
