"""Storage faults: bytes flipped in a held snapshot (a keeper's shared-memory slot, own or
replica) or in a tier object (disk file, S3 object), tier checkpoints truncated or
deleted. Restore verifies every checksum, so a damaged copy is refused and the next
source on the ladder is used."""
from __future__ import annotations

from typing import Any, Mapping

import ray

from phalanx.runtime.base import node_name
from phalanx.configs.errors import ConfigError
from phalanx.launcher.drills.catalogue import FaultEnv, FaultSpec, Mechanism, register

WHERE = ("own", "replica", "disk", "s3")
TIERS = ("disk", "s3")
KEEPER_TIMEOUT_S = 10.0


def flip_file(path: str, offset: int, bit: int = 0) -> int:
    """Flip bit ``bit`` of the byte at ``offset`` (negative: from the end) in place."""
    with open(path, "r+b") as handle:
        size = handle.seek(0, 2)
        where = offset if offset >= 0 else size + offset
        handle.seek(where)
        byte = handle.read(1)
        handle.seek(where)
        handle.write(bytes([byte[0] ^ (1 << bit)]))
    return where


def _rank(spec: FaultSpec, env: FaultEnv) -> int:
    assert spec.rank is not None
    if spec.rank >= env.config().job.world_size:
        raise ConfigError(f"faults[{spec.index}].target.rank", f"{spec.rank} is not a rank",
                          f"use 0..{env.config().job.world_size - 1}")
    return spec.rank


def _keeper_files(env: FaultEnv, rank: int, kind: str) -> list[dict[str, Any]]:
    """Every ready snapshot of ``rank`` of ``kind`` (own or replica) on the live keepers."""
    cfg = env.config()
    files = []
    for node in range(cfg.job.nodes):
        actor = env.keeper_actor(node)
        if actor is None:
            continue
        try:
            held = ray.get(actor.snapshot_files.remote(rank), timeout=KEEPER_TIMEOUT_S)
        except Exception:  # a keeper gone with its node holds nothing to damage
            continue
        files += [{**f, "node": node_name(node)} for f in held if f["kind"] == kind]
    return files


def corrupt_snapshot(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """Flip one bit in the payload of every held copy of ``where`` (all steps a keeper
    holds of the rank, so whichever step recovery picks is damaged), or of the newest
    complete tier step."""
    rank, where = _rank(spec, env), spec.params["where"]
    if where in TIERS:
        step, tier = _tier_step(spec, env, where)
        payload, manifest = tier.read_rank(step, rank)
        damaged = bytearray(payload)
        damaged[len(damaged) // 2] ^= 1 << spec.params["bit"]
        tier.write_rank(step, rank, bytes(damaged), manifest)
        return {"where": where, "step": step, "offset": len(damaged) // 2}
    files = _keeper_files(env, rank, where)
    if not files:
        raise ConfigError(f"faults[{spec.index}].params.where", f"rank {rank} has no {where} "
                          "snapshot in any keeper yet", "trigger the fault later (at_step)")
    flipped: set[tuple[str, int]] = set()
    for held in files:      # (a replica's middle byte may lie in a snapshot it shares:
        path, offset = held.get("middle") or (held["path"], held["nbytes"] // 2)
        if (path, offset) not in flipped:    # flipped twice, a bit would come back)
            flipped.add((path, offset))
            flip_file(path, offset, spec.params["bit"])
        held["offset"] = offset
    return {"where": where, "copies": [{k: f[k] for k in ("node", "step", "offset")}
                                       for f in files]}


def truncate_snapshot(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    rank, where = _rank(spec, env), spec.params["where"]
    step, tier = _tier_step(spec, env, where)
    payload, manifest = tier.read_rank(step, rank)
    keep = int(len(payload) * spec.params["keep_fraction"])
    tier.write_rank(step, rank, payload[:keep], manifest)
    return {"where": where, "step": step, "bytes_before": len(payload), "bytes_after": keep}


def delete_snapshot(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    where = spec.params["where"]
    step, tier = _tier_step(spec, env, where)
    tier.delete_step(step)
    return {"where": where, "step": step, "deleted": "every rank of the step"}


def _tier_step(spec: FaultSpec, env: FaultEnv, where: str) -> tuple[int, Any]:
    from phalanx.runtime.tiers.config import build_tiers

    if where not in TIERS:
        raise ConfigError(f"faults[{spec.index}].params.where", f"{where!r} is not a tier",
                          f"{spec.kind} acts on a tier: use one of {list(TIERS)}")
    tiers = {t.name: t for t, _, _ in build_tiers(env.config(), str(env.run_dir))}
    if where not in tiers:
        raise ConfigError(f"faults[{spec.index}].params.where", f"tier {where} is not enabled",
                          f"enable tiers.{where} in the job's config")
    steps = tiers[where].committed_steps()
    if not steps:
        raise ConfigError(f"faults[{spec.index}].trigger", f"tier {where} holds no complete "
                          "step yet", f"trigger later than tiers.{where}.every_steps")
    return max(steps), tiers[where]


register(Mechanism("corrupt_snapshot", "storage", "rank", corrupt_snapshot,
                   "flip a bit in the rank's held snapshots (own or replica keeper copies) or "
                   "in its newest tier object (disk, s3)",
                   params={"where": (str, "own"), "bit": (int, 0)},
                   choices={"where": WHERE, "bit": tuple(range(8))}, recovers="none",
                   chaos=True,
                   response=("restore verifies checksums: the damaged copy is "
                             "refused and the next source is used")))
register(Mechanism("truncate_snapshot", "storage", "rank", truncate_snapshot,
                   "cut the rank's newest tier object short (disk, s3)",
                   params={"where": (str, "disk"), "keep_fraction": (float, 0.5)},
                   choices={"where": TIERS}, recovers="none",
                   response=("refused at restore (and by phalanx ckpt verify); the "
                             "next source is used")))
register(Mechanism("delete_snapshot", "storage", "none", delete_snapshot,
                   "delete the newest complete tier checkpoint (disk, s3)",
                   params={"where": (str, "disk")}, choices={"where": TIERS},
                   recovers="none",
                   response=("restore uses the next source (an older complete step, "
                             "another tier)")))
