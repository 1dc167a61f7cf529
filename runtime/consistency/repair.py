"""Repair of a rank's replicated state from a healthy peer: after a silent-corruption
rollback, the corrupted rank loads the data-parallel replicated objects (model, optimizer)
of the restore step from a peer rank's snapshot, verified by checksum, instead of its own;
its per-rank state (RNG, data cursor, extras) stays its own.

The plan names the peer as a ``PeerCopy`` among the rank's restore sources
(``phalanx.runtime.base.RestoreSource``); the ordinary ladder takes the others.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch

from phalanx.configs.errors import PhalanxError, SnapshotNotFound
from phalanx.runtime.base import KeeperCopy, PeerCopy, RestoreSource, TierCopy
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.format import Manifest, read_tensors
from phalanx.runtime.snapshot.spec_names import escape_segment
from phalanx.runtime.snapshot.state_tree import apply_state

log = logging.getLogger(__name__)


def split_sources(sources: Sequence[RestoreSource]
                  ) -> tuple[list[KeeperCopy | TierCopy], list[PeerCopy]]:
    """(ladder sources, peer repair sources) of a rank's plan sources, each in plan order."""
    ladder = [s for s in sources if not isinstance(s, PeerCopy)]
    return ladder, [s for s in sources if isinstance(s, PeerCopy)]


def repair_from_peer(objects: Mapping[str, Any], step: int, source: PeerCopy, *,
                     job: str, secret: bytes | None, timeout_s: float,
                     generation: int) -> str:
    """Load ``source.objects`` of ``objects`` from the peer's verified snapshot of
    ``step`` (in place, like a restore); returns the source's name. Raises
    ``PhalanxError`` (unreachable, not held, corrupt, unauthenticated) or ``OSError``."""
    peer, node = int(source.peer), str(source.node)
    where = f"peer rank {peer} keeper {node}"
    names = [n for n in source.objects if n in objects]
    if not names:
        raise SnapshotNotFound(f"{where}: none of {list(source.objects)} is registered")
    with KeeperClient(source.host, source.port, secret or b"", job,
                      timeout_s=timeout_s, role="restore", generation=generation) as client:
        got, manifest_bytes, payload = client.get(peer, step)
    if got != step:
        raise SnapshotNotFound(f"{where} returned step {got}, wanted {step}")
    manifest = Manifest.from_json(manifest_bytes, source=where)
    manifest.verify(secret, source=where)
    if manifest.rank != peer or manifest.step != step or manifest.job != job:
        raise SnapshotNotFound(f"{where}: manifest names job {manifest.job!r} rank "
                               f"{manifest.rank} step {manifest.step}")
    tensors = read_tensors(memoryview(payload)[:manifest.total_bytes], verify_against=manifest,
                           source=where, workers=max(1, torch.get_num_threads()))
    spec = manifest.tree_spec
    prefixes = {escape_segment(name) for name in names}
    chosen = {name: t for name, t in tensors.items() if name.split("/", 1)[0] in prefixes}
    subset: dict[str, Any] = {"version": spec.get("version"),
                              "objects": {name: spec.get("objects", {}).get(name) for name in names}}
    if any(entry is None for entry in subset["objects"].values()):
        raise SnapshotNotFound(f"{where}: the snapshot holds objects "
                               f"{sorted(spec.get('objects', {}))}, not all of {names}")
    apply_state({name: objects[name] for name in names}, chosen, subset)
    del tensors, chosen
    log.info("event=replicas_repaired step=%d source=%r objects=%s", step, where, names)
    return where


def try_repair(objects: Mapping[str, Any], step: int,
               sources: Sequence[PeerCopy], **kwargs: Any) -> str | None:
    """``repair_from_peer`` from the first peer source that works; None when none does
    (the rank keeps its own verified state of ``step``, equal to its peers' by digest)."""
    for source in sources:
        try:
            return repair_from_peer(objects, step, source, **kwargs)
        except (PhalanxError, OSError, ValueError, KeyError) as exc:
            log.warning("event=replica_repair_failed step=%d source=%r error=%s", step,
                        source, exc)
    return None
