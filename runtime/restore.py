"""Restore one rank's snapshot from the best source, in ladder order: own node keeper,
replica keepers, disk tier, S3 tier. Every source is verified (manifest HMAC, per-tensor
checksums); on any error the next source is tried and the reason logged."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from configs.errors import PhalanxError, SnapshotNotFound
from runtime.base import Tier
from runtime.keeper_wire import KeeperClient
from runtime.snapshot_format import Manifest, read_tensors
from runtime.state_tree import apply_state

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Where a snapshot can come from; ``fetch`` raises a ``PhalanxError`` on failure."""

    name: str

    def fetch(self, rank: int, step: int) -> tuple[bytes, Any]:
        """(manifest bytes, payload buffer) of ``rank`` at ``step``."""


@dataclass
class KeeperSource:
    """A node keeper reached over TCP (its own node's or a replica holder)."""

    name: str
    client_factory: Callable[[], KeeperClient]

    def fetch(self, rank: int, step: int) -> tuple[bytes, Any]:
        with self.client_factory() as client:
            got_step, manifest, payload = client.get(rank, step)
        if got_step != step:
            raise SnapshotNotFound(f"{self.name} returned step {got_step}, wanted {step}")
        return manifest, payload


@dataclass
class TierSource:
    tier: Tier
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"tier {self.tier.name}"

    def fetch(self, rank: int, step: int) -> tuple[bytes, Any]:
        payload, manifest = self.tier.read_rank(step, rank)
        return manifest, payload


@dataclass
class RestoreResult:
    rank: int
    step: int
    source: str
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    failures: list[tuple[str, str]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # restored plain values, by name


def fetch_verified(rank: int, step: int, sources: Sequence[SnapshotSource],
                   secret: bytes | None, job: str | None = None) -> RestoreResult:
    """The first source whose snapshot of (rank, step) verifies; raises ``SnapshotNotFound``
    naming every source tried and why it was refused."""
    failures: list[tuple[str, str]] = []
    for source in sources:
        try:
            manifest_bytes, payload = source.fetch(rank, step)
            where = f"{source.name} rank {rank} step {step}"
            manifest = Manifest.from_json(bytes(manifest_bytes), source=where)
            manifest.verify(secret, source=where)
            if manifest.rank != rank or manifest.step != step or (job and manifest.job != job):
                raise SnapshotNotFound(f"{where}: manifest names job {manifest.job!r} rank "
                                       f"{manifest.rank} step {manifest.step}")
            view = memoryview(payload)[:manifest.total_bytes]
            tensors = read_tensors(view, verify_against=manifest, source=where)
            log.info("event=restore_source rank=%d step=%d source=%r tried=%d", rank, step,
                     source.name, len(failures) + 1)
            return RestoreResult(rank, step, source.name, manifest, tensors, failures)
        except (PhalanxError, OSError) as exc:
            failures.append((source.name, f"{type(exc).__name__}: {exc}"))
            log.warning("event=restore_source_refused rank=%d step=%d source=%r error=%s",
                        rank, step, source.name, exc)
    tried = "; ".join(f"{name}: {why}" for name, why in failures) or "no sources"
    raise SnapshotNotFound(f"rank {rank} step {step}: no source verified ({tried})")


def restore(objects: Mapping[str, Any], rank: int, step: int,
            sources: Sequence[SnapshotSource], secret: bytes | None,
            job: str | None = None) -> RestoreResult:
    """Pull (rank, step) from the first good source and apply it to ``objects`` in place.

    Plain values (an int, a str) cannot be changed in place: they are rebound in
    ``objects`` when it is a dict and returned in ``RestoreResult.values`` (see
    ``apply_state``)."""
    result = fetch_verified(rank, step, sources, secret, job)
    result.values = apply_state(objects, result.tensors, result.manifest.tree_spec)
    return result
