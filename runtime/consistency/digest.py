"""Digests of a rank's data-parallel replicated state, and the small integer vector that
compares them across ranks in one all-reduce (pure: no torch, no I/O).

In a data-parallel job the registered model's parameters and the optimizer
(``detection.replicated_state``) are bit-identical on every rank after each step, so the
checksums a snapshot computes anyway must agree too. A module's buffers are not: BatchNorm
without SyncBatchNorm keeps per-rank running statistics (DDP broadcasts buffers before each
forward, and the forward then updates them from the rank's own batch), so buffers are
per-rank state and never compared. A rank's *replica digest* of a step is a 60-bit hash over those
checksums (and the JSON trees of those objects); silent data corruption on one rank (a
flipped bit in its parameters) shows as a digest that differs from the other ranks'.
Sharded state is never compared either: a DTensor with a ``Shard`` placement (FSDP2
parameters and their optimizer state) holds a different shard on each rank, so its local
shard is left out and its spec node is compared without the rank's mesh coordinate. An
FSDP2 job's digests then cover only its structure and agree, and its commit point moves on.

Replicated state is alike within its replica group only: every rank in a plain DDP job,
but each group's ranks alone when DDP runs on ``dist.new_group`` groups that train models
of their own (pipeline stages, an ensemble) or in HSDP
(``phalanx.runtime.snapshot.state_classes``). Digests are compared within each group.

Comparing without gathering every digest: each rank contributes

    [1, s0, s1, s2, s0², s1², s2²]  then one slot per possible group
    [1, d0, d1, d2, d0², d1², d2²]  in the slot of its group (its lowest rank; 0 for a
                                    group of every rank), zeros in the others

(``s*`` the 20-bit chunks of the step, ``d*`` those of the digest; zeros when it has no
digest to offer) and the all-reduce sums them. Values v_1..v_n are all equal exactly when
n·Σv² = (Σv)² (Cauchy-Schwarz), so from the sums every rank reads the same outcome:
``agreed`` at the step (every group's digests equal), ``diverged`` at the step (some
group's differ), or ``unknown`` (a rank had no digest, or the ranks offered different
steps). Sums stay below W·2^40: exact in int64 for any world size under 2^23. The vector
has 7·(W + 1) integers: 57 KB at W = 1,024, reduced in the background of the steps.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import AbstractSet, Any, Iterable, Literal, Mapping, Sequence

from phalanx.runtime.snapshot.spec_names import DTENSOR_TAG as DTENSOR, escape_segment

REPLICAS_EXTRA = "replicas"      # the member record's ``extra`` key the session fills
CHUNK_BITS = 20
CHUNKS = 3                       # 60 bits of step and of digest
DIGEST_BITS = CHUNK_BITS * CHUNKS
PART = 1 + 2 * CHUNKS            # [count, chunks, squares]: the step's part, and each slot
_MASK = (1 << CHUNK_BITS) - 1


def replica_digest(sums: Mapping[str, str], spec: Mapping[str, Any],
                   names: Sequence[str], per_rank: AbstractSet[str] = frozenset()) -> str | None:
    """The digest (15 hex digits) over the checksums of the tensors of objects ``names``
    (a snapshot's ``{tensor name: "<algo>:<hex>"}``) and those objects' tree specs; None
    when the snapshot holds none of them. Tensors in ``per_rank`` (a module's buffers, such
    as BatchNorm's running statistics: each rank updates them from its own batches) are
    left out: only state that is replicated by construction is compared."""
    objects = spec.get("objects", {}) if isinstance(spec, Mapping) else {}
    present = sorted(name for name in set(names) if name in objects)
    if not present:
        return None
    prefixes = {escape_segment(name) for name in present}
    sharded: set[str] = set()
    trees = {name: _unsharded(objects[name], sharded) for name in present}
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps(trees, sort_keys=True, separators=(",", ":")).encode())
    for tensor, checksum in sorted(sums.items()):
        if tensor.split("/", 1)[0] in prefixes and tensor not in per_rank \
                and tensor not in sharded:
            digest.update(f"\n{tensor}={checksum}".encode())
    value = int.from_bytes(digest.digest(), "big") & ((1 << DIGEST_BITS) - 1)
    return f"{value:0{DIGEST_BITS // 4}x}"


def _unsharded(node: Any, sharded: set[str]) -> Any:
    """``node`` (a tree spec) as every rank of the group writes it: a DTensor node with a
    ``Shard`` placement loses its ``coord`` (the rank's place in the mesh), and the name of
    its local shard is added to ``sharded``."""
    if isinstance(node, list):
        return [_unsharded(item, sharded) for item in node]
    if not isinstance(node, Mapping):
        return node
    if node.get("t") == DTENSOR and any(isinstance(p, Mapping) and "shard" in p
                                        for p in node.get("placements") or ()):
        sharded.add(str(node.get("name")))
        return {k: v for k, v in node.items() if k != "coord"}
    return {k: _unsharded(v, sharded) for k, v in node.items()}


def never_agreed_message(names: Sequence[str], step: int) -> str:
    """What ``ReplicasNeverAgreed`` says, on a rank or in the launcher."""
    return (f"the replicated state {list(names)} (detection.replicated_state) differed "
            f"across ranks at step {step}, the first step compared, and no step ever "
            "agreed: the ranks did not start from the same state, which is not silent "
            "corruption. Seed the initialisation identically on every rank or broadcast it "
            "from rank 0 (DistributedDataParallel does), list only objects that are "
            "identical on every rank in detection.replicated_state, or set "
            "detection.compare_replicas: false")


def _chunks(value: int) -> list[int]:
    return [(value >> (CHUNK_BITS * i)) & _MASK for i in range(CHUNKS)]


def vector_len(slots: int) -> int:
    """The comparison vector's length with ``slots`` group slots."""
    return PART * (1 + slots)


def group_slot(group: Sequence[int]) -> int:
    """The slot of a rank's replica group (``StateClasses.group``): its lowest rank; 0 for
    a group of every rank."""
    return min(group) if group else 0


def _part(values: Sequence[int]) -> list[int]:
    return [1, *values, *(v * v for v in values)]


def agreement_vector(step: int | None, digest: str | None, slots: int = 1,
                     slot: int = 0) -> list[int]:
    """What one rank adds to the comparison of ``step``: zeros when it has no digest;
    ``slots`` the same on every rank (the world size), ``slot`` its group's."""
    vector = [0] * vector_len(slots)
    if step is None or digest is None:
        return vector
    if not 0 <= slot < slots:
        raise ValueError(f"group slot {slot} outside 0..{slots - 1}")
    vector[:PART] = _part(_chunks(step))
    at = PART * (1 + slot)
    vector[at:at + PART] = _part(_chunks(int(digest, 16)))
    return vector


@dataclass(frozen=True)
class Agreement:
    """What the summed vectors say about one snapshot step (-1: no step known)."""

    state: Literal["agreed", "diverged", "unknown"]
    step: int = -1


def _equal(part: Sequence[int]) -> bool:
    """Whether the ``part[0]`` values summed into ``part`` were all equal."""
    count, plain, squares = int(part[0]), part[1:1 + CHUNKS], part[1 + CHUNKS:]
    return all(count * int(q) == int(v) * int(v) for v, q in zip(plain, squares))


def read_agreement(sums: Sequence[int], world_size: int, slots: int = 1) -> Agreement:
    """The outcome of the all-reduce of ``agreement_vector``s over ``world_size`` ranks."""
    if len(sums) != vector_len(slots) or int(sums[0]) != world_size or world_size < 1:
        return Agreement("unknown")
    if not _equal(sums[:PART]):           # ranks offered different steps
        return Agreement("unknown")
    step = sum((int(s) // world_size) << (CHUNK_BITS * i) for i, s in enumerate(sums[1:1 + CHUNKS]))
    parts = [sums[at:at + PART] for at in range(PART, len(sums), PART)]
    agreed = all(_equal(part) for part in parts if int(part[0]))
    return Agreement("agreed" if agreed else "diverged", step)


@dataclass(frozen=True)
class ReplicaStatus:
    """One rank's published view (member record ``extra["replicas"]``): the newest step
    verified job-wide, its recent (step, digest) pairs, a divergence it found (step, its
    own digest there, the generation it ran in), if any, and the ranks its digests are
    compared with (its replica group; (): every rank)."""

    verified: int
    recent: tuple[tuple[int, str], ...] = ()
    diverged: tuple[int, str, int] | None = None
    group: tuple[int, ...] = ()

    def to_extra(self) -> dict[str, Any]:
        diverged = None if self.diverged is None else {
            "step": self.diverged[0], "digest": self.diverged[1], "generation": self.diverged[2]}
        return {"verified": self.verified, "recent": [list(p) for p in self.recent],
                "diverged": diverged, "group": list(self.group)}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "ReplicaStatus | None":
        """The status in a member record's ``extra``; None when absent or malformed."""
        raw = extra.get(REPLICAS_EXTRA)
        if not isinstance(raw, Mapping) or type(raw.get("verified")) is not int:
            return None
        try:
            recent = tuple((int(s), str(d)) for s, d in raw.get("recent") or ())
            found = raw.get("diverged")
            diverged = None if not isinstance(found, Mapping) else (
                int(found["step"]), str(found["digest"]), int(found["generation"]))
            group = tuple(int(r) for r in raw.get("group") or ())
        except (KeyError, TypeError, ValueError):
            return None
        return cls(raw["verified"], recent, diverged, group)


def verified_ceiling(extras: Iterable[Mapping[str, Any]]) -> int | None:
    """The newest step verified job-wide that any rank publishes (a verified step agreed
    on every rank, so any rank's word is enough); None when no rank compares replicas."""
    found = [s.verified for s in map(ReplicaStatus.from_extra, extras) if s is not None]
    return max(found) if found else None
