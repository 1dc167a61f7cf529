"""``phalanx launch --resume [STEP|latest]``: find an earlier run's committed checkpoint of
the same job in the tiers, verify it fits this launch (world size, HMAC, every tensor
checksum) before anything starts, and hand every rank its restore.

Where earlier runs' checkpoints are: the disk tier at ``tiers.disk.path`` (shared by the
job's launches), or, with that empty, each earlier run directory's own
``<job.run_dir>/<job>-*/checkpoints``; and the S3 tier when enabled. ``latest`` is the
newest committed step by its marker's time; ``STEP`` that step (the newest run's when
several runs have it). The checkpoint stays the earlier run's: this run's own checkpoints
carry its own run id, and nothing of the earlier run is deleted by this run's retention.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.configs.errors import (ResumeRefused, SnapshotCorrupt, SnapshotNotFound,
                                    SnapshotUnauthenticated, TierUnavailable)
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.base import Tier, TierCopy, source_to_json
from phalanx.runtime.tiers.config import read_job_secret
from phalanx.runtime.tiers.disk import COMMIT_NAME, DiskTier
from phalanx.runtime.tiers.run_identity import marker_fields

log = logging.getLogger(__name__)

LATEST = "latest"


@dataclass(frozen=True)
class Checkpoint:
    """One committed step of one run in one tier."""

    tier: str
    location: str          # the tier's job folder or s3:// prefix, for messages
    root: str              # the disk tier's root ("" for S3)
    step: int
    run: str               # "" when written before run ids existed
    ranks: tuple[int, ...]
    written_at: float

    def describe(self) -> str:
        return (f"step {self.step} of run {self.run or '(unknown run)'} in tier {self.tier} "
                f"({self.location}, {len(self.ranks)} ranks)")


@dataclass(frozen=True)
class ResumePoint:
    """The verified checkpoint a launch resumes from and the secret it was signed with."""

    checkpoint: Checkpoint
    secret: bytes | None

    def restore_for(self, cfg: PhalanxConfig) -> dict[str, Any]:
        """The ``restore`` every rank's context carries: the step and its tier source."""
        ckpt = self.checkpoint
        source = (TierCopy(tier="disk", path=ckpt.root) if ckpt.tier == "disk" else
                  TierCopy(tier="s3", s3=dataclasses.asdict(cfg.tiers.s3)))
        return {"step": ckpt.step, "sources": [source_to_json(source)]}

    def event_fields(self) -> dict[str, Any]:
        ckpt = self.checkpoint
        return {"run_id": ckpt.run, "step": ckpt.step, "tier": ckpt.tier,
                "location": ckpt.location, "ranks": len(ckpt.ranks)}


def parse_resume(value: str) -> str:
    """argparse type of ``--resume``: ``latest`` or a step number."""
    if value == LATEST or (value.isdigit() and int(value) >= 0):
        return value
    import argparse

    raise argparse.ArgumentTypeError(f"{value!r} is neither 'latest' nor a step number (write "
                                     "`--resume latest` or put a bare --resume last)")


def _tiers(cfg: PhalanxConfig) -> list[tuple[Tier, str, str]]:
    """(unbound tier, location, disk root) of every place an earlier run's checkpoints of
    this job can be (see the module docstring)."""
    job = cfg.job.name
    found: list[tuple[Tier, str, str]] = []
    if cfg.tiers.disk.enabled:
        if cfg.tiers.disk.path:
            roots = [Path(cfg.tiers.disk.path)]
        else:
            runs_root = Path(cfg.job.run_dir)
            roots = sorted(p / "checkpoints" for p in runs_root.glob(f"{job}-*")
                           if (p / "checkpoints" / job).is_dir())
        for root in roots:
            tier = DiskTier(root, job)
            found.append((tier, str(tier.job_dir), str(root)))
    if cfg.tiers.s3.enabled and cfg.tiers.s3.bucket:
        from phalanx.runtime.tiers.s3 import S3Tier

        s3 = S3Tier(cfg.tiers.s3, job)
        found.append((s3, f"s3://{cfg.tiers.s3.bucket}/{cfg.tiers.s3.prefix.strip('/')}", ""))
    return found


def list_checkpoints(cfg: PhalanxConfig) -> list[Checkpoint]:
    """Every committed step of the job in every tier, oldest first. Raises ResumeRefused
    when a tier cannot be listed."""
    found = []
    for tier, location, root in _tiers(cfg):
        try:
            for step in tier.committed_steps():
                fields = marker_fields(tier.get_object(step, COMMIT_NAME))  # type: ignore[attr-defined]
                ranks = tuple(r for r in fields.get("ranks", []) if type(r) is int)
                found.append(Checkpoint(tier.name, location, root, step,
                                        str(fields.get("run", "") or ""), ranks,
                                        float(fields.get("written_at", 0.0) or 0.0)))
        except TierUnavailable as exc:
            raise ResumeRefused(f"--resume: cannot list tier {tier.name} at {location}: {exc}; "
                                "fix the tier's access or disable it for this launch") from exc
    return sorted(found, key=lambda c: (c.written_at, c.step))


def choose(checkpoints: list[Checkpoint], spec: str, job: str) -> Checkpoint:
    """The checkpoint ``spec`` names; raises ResumeRefused listing what exists."""
    wanted = checkpoints if spec == LATEST else [c for c in checkpoints if c.step == int(spec)]
    if wanted:
        return wanted[-1]
    listing = "; ".join(c.describe() for c in checkpoints[-10:]) or "none"
    raise ResumeRefused(f"--resume {spec}: no committed checkpoint of job {job!r}"
                        f"{'' if spec == LATEST else f' at step {spec}'} in the enabled tiers "
                        f"(committed checkpoints, newest last: {listing}); resume from one of "
                        "those, check tiers.disk.path / tiers.s3 and job.name, or launch "
                        "without --resume to start from scratch")


def source_secret(cfg: PhalanxConfig, ckpt: Checkpoint) -> bytes | None:
    """The secret ``ckpt``'s manifests were signed with: ``security.secret_file``'s, else
    the earlier run's own (``<job.run_dir>/<run>/secret``). Raises ResumeRefused when
    neither exists (its HMAC could not be checked)."""
    configured = read_job_secret(cfg)
    if configured is not None:
        return configured
    path = Path(cfg.job.run_dir) / ckpt.run / "secret" if ckpt.run else None
    if path is not None and path.is_file():
        return path.read_bytes().rstrip(b"\n")
    raise ResumeRefused(f"--resume: {ckpt.describe()} was signed with its run's own secret, "
                        f"and {path or 'its run directory'} is gone; set security.secret_file "
                        "to the secret it was written with (or keep job.run_dir's run "
                        "directories), so its HMAC can be checked")


def verify(cfg: PhalanxConfig, ckpt: Checkpoint, secret: bytes | None) -> None:
    """World size, then every rank's HMAC and tensor checksums; raises ResumeRefused naming
    the step, what does not fit and the fix."""
    from phalanx.runtime.snapshot.format import verify_snapshot

    world = cfg.job.world_size
    if ckpt.ranks != tuple(range(world)):
        raise ResumeRefused(f"--resume: {ckpt.describe()} holds {len(ckpt.ranks)} ranks but "
                            f"this launch has job.world_size {world}; resume with the world "
                            f"size it was written with (--set job.world_size={len(ckpt.ranks)})"
                            " or choose a checkpoint of this world size (`phalanx ckpt list`)")
    tier = next(t for t, location, _ in _tiers(cfg) if location == ckpt.location)
    for rank in ckpt.ranks:
        where = f"{ckpt.describe()} rank {rank}"
        try:
            payload, manifest = tier.read_rank(ckpt.step, rank)
            parsed = verify_snapshot(payload, manifest, secret=secret, source=where)
        except (TierUnavailable, SnapshotNotFound) as exc:
            raise ResumeRefused(f"--resume: reading {where} failed: {exc}") from exc
        except (SnapshotCorrupt, SnapshotUnauthenticated) as exc:
            kind = "corrupt" if isinstance(exc, SnapshotCorrupt) else "unauthenticated"
            raise ResumeRefused(f"--resume: {where} is {kind}: {exc}; resume from another "
                                "step (`phalanx ckpt list`; `phalanx ckpt verify` checks "
                                "one)") from exc
        if (parsed.job, parsed.rank, parsed.step) != (cfg.job.name, rank, ckpt.step):
            raise ResumeRefused(f"--resume: {where} holds a manifest of job {parsed.job!r} "
                                f"rank {parsed.rank} step {parsed.step} (misplaced files)")


def find_resume_point(cfg: PhalanxConfig, spec: str) -> ResumePoint:
    """The verified checkpoint ``spec`` ("latest" or a step) names. Raises ResumeRefused."""
    ckpt = choose(list_checkpoints(cfg), spec, cfg.job.name)
    secret = source_secret(cfg, ckpt)
    verify(cfg, ckpt, secret)
    log.info("event=resume_point run=%s step=%d tier=%s location=%s", ckpt.run, ckpt.step,
             ckpt.tier, ckpt.location)
    return ResumePoint(ckpt, secret)


def adopt_secret(run_path: Path, point: ResumePoint, cfg: PhalanxConfig) -> None:
    """Without ``security.secret_file`` a run signs with a secret of its own; a resumed
    run keeps the one the checkpoint was signed with (written to its run directory,
    mode 0600, before ``job_secret`` reads it)."""
    import os

    if cfg.security.secret_file or point.secret is None:
        return
    fd = os.open(run_path / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(point.secret + b"\n")


def announce(point: ResumePoint, events: Any, console: Any) -> None:
    """The console line and the ``resumed_from`` event (events.jsonl, the run summary)."""
    fields = point.event_fields()
    events.emit("resumed_from", **fields)
    console.print(f"phalanx: resuming from {point.checkpoint.describe()}: every rank restores "
                  f"it, training continues at step {fields['step'] + 1}", markup=False)
