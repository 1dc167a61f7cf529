"""How a rank joins a new generation: turn the plan's restore sources into ladder sources,
pull and apply the rank's state at the restore step, and re-form the collective."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, assert_never

from phalanx.configs.errors import PhalanxError
from phalanx.configs.schema import S3TierConfig
from phalanx.runtime.base import KeeperCopy, TierCopy
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.restore import (KeeperSource, RestoreResult, SnapshotSource,
                                              TierSource, restore)
from phalanx.runtime.tiers.disk import DiskTier

log = logging.getLogger(__name__)


def ladder_sources(plan_sources: Sequence[KeeperCopy | TierCopy], *, job: str,
                   secret: bytes | None, timeout_s: float, generation: int,
                   local_node: str | None = None) -> list[SnapshotSource]:
    """Sources for ``restore`` from the plan's typed sources, in the plan's order; the
    keeper of ``local_node`` (this process's node) lends its slots to be mapped."""
    sources: list[SnapshotSource] = []
    for item in plan_sources:
        match item:
            case KeeperCopy(node=node, host=host, port=port):
                def factory(host: str = host, port: int = port) -> KeeperClient:
                    return KeeperClient(host, port, secret or b"", job, timeout_s=timeout_s,
                                        role="restore", generation=generation)

                sources.append(KeeperSource(f"keeper {node}", factory,
                                            local=local_node is not None and node == local_node))
            case TierCopy(tier="disk", path=path):
                sources.append(TierSource(DiskTier(Path(path), job)))
            case TierCopy(tier="s3", s3=s3):
                from phalanx.runtime.tiers.s3 import S3Tier

                sources.append(TierSource(S3Tier(S3TierConfig(**s3), job)))
            case TierCopy(tier=tier):
                log.warning("event=unknown_restore_tier tier=%r", tier)
            case _:
                assert_never(item)
    return sources


def restore_rank(objects: Mapping[str, Any], rank: int, step: int,
                 descriptors: Sequence[KeeperCopy | TierCopy], *, job: str, secret: bytes | None,
                 timeout_s: float, generation: int,
                 local_node: str | None = None) -> RestoreResult:
    """Apply (rank, step) from the first verified source; raises ``SnapshotNotFound``."""
    started = time.perf_counter()
    sources = ladder_sources(descriptors, job=job, secret=secret, timeout_s=timeout_s,
                             generation=generation, local_node=local_node)
    result = restore(objects, rank, step, sources, secret, job)
    log.info("event=rank_restored rank=%d step=%d source=%r bytes=%d seconds=%.3f", rank, step,
             result.source, result.manifest.total_bytes, time.perf_counter() - started)
    return result


def holdings_probe(keepers: Sequence[KeeperCopy], rank: int, *, job: str,
                   secret: bytes | None, timeout_s: float,
                   generation: int) -> Callable[[int], bool]:
    """``probe(step)``: whether one of ``keepers`` holds ``rank``'s snapshot of ``step``
    (each keeper asked once, at the first probe, for its holdings; an unreachable one
    holds nothing)."""
    held: set[int] | None = None

    def probe(step: int) -> bool:
        nonlocal held
        if held is None:
            held = set()
            for source in keepers:
                try:
                    with KeeperClient(source.host, source.port, secret or b"", job,
                                      timeout_s=timeout_s, role="restore",
                                      generation=generation) as client:
                        info = client.holdings().get(rank, {})
                except (PhalanxError, OSError) as exc:
                    log.info("event=heal_probe_failed keeper=%s error=%s", source.node, exc)
                    continue
                held.update(info.get("local", []) + info.get("replica", []))
        return step in held
    return probe
