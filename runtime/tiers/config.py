"""The tiers and job secret a phalanx config names, opened from that config alone: by the
node keepers of a launched job, by DCP users outside one (``TieredStorageWriter.from_config``)
and by tools, all with the same tier roots and job name, so each sees what the others wrote."""
from __future__ import annotations

import os
from pathlib import Path

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.base import Tier
from phalanx.runtime.tiers.disk import DiskTier
from phalanx.runtime.tiers.run_identity import run_id_of

TIERS = ("disk", "s3")
MIN_SECRET_BYTES = 16


def disk_tier_root(cfg: PhalanxConfig, run_dir: str | os.PathLike[str] | None) -> Path:
    """``tiers.disk.path``, or ``<run dir>/checkpoints`` when it is empty. Raises
    ConfigError when both are missing (outside a launched job there is no run dir)."""
    if cfg.tiers.disk.path:
        return Path(cfg.tiers.disk.path)
    if run_dir is None:
        raise ConfigError("tiers.disk.path", "is empty, and outside a launched job there is "
                          "no run directory to keep checkpoints in",
                          "set tiers.disk.path to a folder (the one `phalanx launch` should "
                          "use too), or pass run_dir=")
    return Path(run_dir) / "checkpoints"


def open_tier(cfg: PhalanxConfig, name: str = "disk", *,
              run_dir: str | os.PathLike[str] | None = None, namespace: str = "",
              run_id: str = "") -> Tier:
    """The tier ``name`` ("disk" or "s3") of ``cfg`` for job ``cfg.job.name``; a
    ``namespace`` keeps its steps apart, under ``<job>.<namespace>`` (a name no job can
    have: its checkpoints and retention never meet those of the job itself). With a
    ``run_id`` the tier sees, commits and deletes only that run's steps."""
    job = f"{cfg.job.name}.{namespace}" if namespace else cfg.job.name
    if name == "disk":
        return DiskTier(disk_tier_root(cfg, run_dir), job, run_id=run_id)
    if name == "s3":
        if not cfg.tiers.s3.bucket:
            raise ConfigError("tiers.s3.bucket", "is empty", "set the bucket the S3 tier uses")
        from phalanx.runtime.tiers.s3 import S3Tier  # boto3 only when an S3 tier is wanted

        return S3Tier(cfg.tiers.s3, job, run_id=run_id)
    raise ConfigError("tier", f"{name!r} is not a tier", f"use one of {list(TIERS)}")


def tier_specs(cfg: PhalanxConfig, run_dir: str) -> list[tuple[Tier, int, int, float]]:
    """(tier, every_steps, keep, every_s) for each enabled tier: what TierPersister takes.
    Each tier is bound to the run of ``run_dir`` (``run_identity.run_id_of``)."""
    run = run_id_of(run_dir)
    windows = cfg.tiers.windows(cfg.snapshot.every_steps)
    return [(open_tier(cfg, name, run_dir=run_dir, run_id=run), windows[name], t.keep, t.every_s)
            for name, t in (("disk", cfg.tiers.disk), ("s3", cfg.tiers.s3)) if t.enabled]


def build_tiers(cfg: PhalanxConfig, run_dir: str) -> list[tuple[Tier, int, int]]:
    """(tier, every_steps, keep) for each enabled tier (``tier_specs`` adds every_s)."""
    return [(tier, every, keep) for tier, every, keep, _ in tier_specs(cfg, run_dir)]


def read_job_secret(cfg: PhalanxConfig) -> bytes | None:
    """``security.secret_file``'s bytes (a trailing newline dropped), None when unset.
    Raises ConfigError when it cannot be read or holds under 16 bytes."""
    path = cfg.security.secret_file
    if not path:
        return None
    try:
        secret = Path(path).read_bytes().rstrip(b"\r\n")
    except OSError as exc:
        raise ConfigError("security.secret_file", f"{path} cannot be read: "
                          f"{exc.strerror or exc}",
                          "point it at a readable file holding the job secret") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError("security.secret_file", f"{path} holds {len(secret)} bytes",
                          "use at least 16 bytes, e.g. `openssl rand -hex 32 > FILE`")
    return secret
