"""Restore one rank's snapshot from the best source, in ladder order: own node keeper,
replica keepers, disk tier, S3 tier. Every source is verified (manifest HMAC, per-tensor
checksums); on any error the next source is tried and the reason logged."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, Protocol, Sequence

import torch

from phalanx.configs.errors import PhalanxError, SnapshotNotFound
from phalanx.runtime.base import Tier
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.format import Manifest, read_tensors
from phalanx.runtime.snapshot.state_tree import apply_state

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Where a snapshot can come from; ``open`` raises a ``PhalanxError`` on failure."""

    name: str

    def open(self, rank: int, step: int) -> ContextManager[tuple[bytes, Any]]:
        """(manifest bytes, payload buffer) of ``rank`` at ``step``, valid in the block."""


@dataclass
class KeeperSource:
    """A node keeper: its own node's, a replica holder, or one on this host (``local``),
    whose slot is mapped read-only instead of streamed through a socket."""

    name: str
    client_factory: Callable[[], KeeperClient]
    local: bool = False

    @contextlib.contextmanager
    def open(self, rank: int, step: int) -> Iterator[tuple[bytes, Any]]:
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(self.client_factory())
            fetched: tuple[int, bytes, memoryview | bytearray] | None = None
            if self.local:
                try:
                    fetched = stack.enter_context(client.borrow(rank, step))
                except OSError as exc:     # the slot file is not reachable from here
                    log.warning("event=keeper_map_failed source=%r rank=%d step=%d error=%s; "
                                "streaming it instead", self.name, rank, step, exc)
            if fetched is None:
                fetched = client.get(rank, step)
            got_step, manifest, payload = fetched
            if got_step != step:
                raise SnapshotNotFound(f"{self.name} returned step {got_step}, wanted {step}")
            yield manifest, payload


@dataclass
class TierSource:
    tier: Tier
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"tier {self.tier.name}"

    def locate(self, rank: int, step: int) -> str:
        """The tier's key or path of the snapshot, when the tier can say (disk, S3)."""
        locate = getattr(self.tier, "locate", None)
        return locate(step, rank) if callable(locate) else ""

    @contextlib.contextmanager
    def open(self, rank: int, step: int) -> Iterator[tuple[bytes, Any]]:
        payload, manifest = self.tier.read_rank(step, rank)
        yield manifest, payload


@dataclass
class RestoreResult:
    rank: int
    step: int
    source: str
    manifest: Manifest
    failures: list[tuple[str, str]] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # restored plain values, by name


def _verified(rank: int, step: int, where: str, manifest_bytes: bytes, payload: Any,
              secret: bytes | None, job: str | None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    manifest = Manifest.from_json(bytes(manifest_bytes), source=where)
    manifest.verify(secret, source=where)
    if manifest.rank != rank or manifest.step != step or (job and manifest.job != job):
        raise SnapshotNotFound(f"{where}: manifest names job {manifest.job!r} rank "
                               f"{manifest.rank} step {manifest.step}")
    view = memoryview(payload)[:manifest.total_bytes]
    return manifest, read_tensors(view, verify_against=manifest, source=where,
                                  workers=max(1, torch.get_num_threads()))


def restore(objects: Mapping[str, Any], rank: int, step: int,
            sources: Sequence[SnapshotSource], secret: bytes | None,
            job: str | None = None) -> RestoreResult:
    """Apply (rank, step) from the first source whose snapshot verifies, to ``objects`` in
    place; raises ``SnapshotNotFound`` naming every source tried and why it was refused.

    Plain values (an int, a str) cannot be changed in place: they are rebound in
    ``objects`` when it is a dict and returned in ``RestoreResult.values`` (see
    ``apply_state``)."""
    failures: list[tuple[str, str]] = []
    for source in sources:
        where = f"{source.name} rank {rank} step {step}"
        locate = getattr(source, "locate", None)
        location = locate(rank, step) if callable(locate) else ""
        if location:            # name the object a refused snapshot came from
            where += f" ({location})"
        try:
            with source.open(rank, step) as (manifest_bytes, payload):
                manifest, tensors = _verified(rank, step, where, manifest_bytes, payload,
                                              secret, job)
                values = apply_state(objects, tensors, manifest.tree_spec)
                del tensors                 # nothing may outlive the source's buffer
        except (PhalanxError, OSError) as exc:
            failures.append((source.name, f"{type(exc).__name__}: {exc}"))
            log.warning("event=restore_source_refused rank=%d step=%d source=%r error=%s",
                        rank, step, source.name, exc)
            continue
        log.info("event=restore_source rank=%d step=%d source=%r tried=%d", rank, step,
                 source.name, len(failures) + 1)
        return RestoreResult(rank, step, source.name, manifest, failures, values)
    tried = "; ".join(f"{name}: {why}" for name, why in failures) or "no sources"
    raise SnapshotNotFound(f"rank {rank} step {step}: no source verified ({tried})")
