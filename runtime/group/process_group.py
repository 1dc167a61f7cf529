"""The training collective of one generation: a gloo group on the launcher's TCPStore under a
fresh ``PrefixStore("gen<N>/")``, so a new generation never meets an old one's keys."""
from __future__ import annotations

import datetime
import logging
import time
from typing import cast

import torch
import torch.distributed as dist

from phalanx.configs.errors import PeerUnreachable
from phalanx.runtime.context import WorkerContext

log = logging.getLogger(__name__)


def connect_store(ctx: WorkerContext, timeout_s: float) -> dist.Store:
    """A client of the launcher-hosted TCPStore; raises ``PeerUnreachable``."""
    return connect_store_at(ctx.master_addr, ctx.master_port, timeout_s)


def connect_store_at(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the TCPStore at ``host:port``; raises ``PeerUnreachable``."""
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise PeerUnreachable(f"TCPStore {host}:{port} did not answer "
                              f"within {timeout_s} s: {exc}") from exc


def form_group(store: dist.Store, generation: int, rank: int, world_size: int,
               timeout_s: float, name: str = "") -> dist.ProcessGroup:
    """Build generation ``generation``'s gloo group (``name``: a group of some of its ranks,
    ``rank`` and ``world_size`` then within it); blocks until every rank joined."""
    started = time.monotonic()
    prefixed = dist.PrefixStore(f"gen{generation}/" + (f"{name}/" if name else ""), store)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size,
                                  datetime.timedelta(seconds=timeout_s))
    log.info("event=group_formed generation=%d rank=%d world=%d seconds=%.3f%s",
             generation, rank, world_size, time.monotonic() - started,
             f" group={name}" if name else "")
    # torch's stubs type ProcessGroupGloo as a Backend without the collectives it binds
    # (allreduce); it is used only through the ProcessGroup calls it has.
    return cast(dist.ProcessGroup, group)


def all_reduce(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` in place across the group (no-op for a one-rank run)."""
    if group is not None:
        group.allreduce([tensor]).wait()
    return tensor
