"""Capacity faults: the disk tier's filesystem or the keepers' shared-memory filesystem
fills up (a filler file written until the kernel answers ENOSPC, removed after ``for_s``).
So that a drill never fills the machine's real disk or RAM, the job is first pointed at a
small tmpfs of its own, mounted for the run (needs root or CAP_SYS_ADMIN)."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.drills.catalogue import (FaultEnv, FaultSpec, Mechanism, register,
                                               register_preparer)

log = logging.getLogger(__name__)
FILL_CHUNK = 1 << 20
FILLER = "phalanx-drill-filler"


class SmallFs:
    """A tmpfs of ``size_mb`` mounted on a fresh folder; ``close`` unmounts and removes it."""

    def __init__(self, what: str, size_mb: int) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"phalanx-drill-{what}-"))
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700",
                               "tmpfs", str(self.path)], capture_output=True, text=True)
        if done.returncode != 0:
            self.path.rmdir()
            raise ConfigError("drills.scenario", f"a {what} drill mounts a {size_mb} MiB tmpfs "
                              f"and mount said: {done.stderr.strip() or done.returncode}",
                              "run the drill as root (or with CAP_SYS_ADMIN)")

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        try:
            self.path.rmdir()
        except OSError as exc:
            log.warning("event=drill_fs_left path=%s error=%r", self.path, exc)


def prepare(cfg: PhalanxConfig, kinds: set[str]) -> tuple[PhalanxConfig, dict[str, Any]]:
    """Before anything starts: a small tmpfs for the disk tier (``disk_full``) and for the
    keepers' shared memory (``exhaust_memory``), so filling them harms nothing else."""
    services: dict[str, Any] = {}
    if "disk_full" in kinds:
        if not cfg.tiers.disk.enabled:
            raise ConfigError("tiers.disk.enabled", "false, but the drill has disk_full",
                              "enable the disk tier (tiers.disk.enabled: true)")
        disk = services["disk_fs"] = SmallFs("disk", 64)
        cfg = replace(cfg, tiers=replace(cfg.tiers, disk=replace(cfg.tiers.disk,
                                                                   path=str(disk.path))))
    if "exhaust_memory" in kinds:
        shm = services["shm_fs"] = SmallFs("shm", 256)
        cfg = replace(cfg, snapshot=replace(cfg.snapshot, shm_dir=str(shm.path)))
    return cfg, services


def fill(folder: Path) -> int:
    """Write ``folder/FILLER`` until the filesystem refuses (ENOSPC), in 1 MiB blocks then
    4 KiB ones, so not even a small file fits afterwards; returns the bytes written."""
    written = 0
    with open(folder / FILLER, "wb", buffering=0) as handle:
        for block in (FILL_CHUNK, 4096):
            chunk = b"\0" * block
            while True:
                try:
                    written += handle.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    return written


def _fill_fault(spec: FaultSpec, env: FaultEnv, service: str) -> Mapping[str, Any]:
    try:
        folder = env.service(service).path
    except KeyError:
        raise ConfigError(f"faults[{spec.index}].kind", f"{spec.kind} has no filesystem of "
                          "its own to fill", "run it through a scenario (drills.scenario), "
                          "which mounts one before the job starts") from None
    written = fill(folder)

    def free() -> None:
        (folder / FILLER).unlink(missing_ok=True)
        env.emit("drill_fault_end", index=spec.index, kind=spec.kind, freed_bytes=written)

    env.later(spec.params["for_s"], free)
    room = os.statvfs(folder)
    return {"filesystem": str(folder), "filler_bytes": written,
            "left_bytes": room.f_bavail * room.f_frsize, "for_s": spec.params["for_s"]}


def disk_full(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    return _fill_fault(spec, env, "disk_fs")


def exhaust_memory(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    return _fill_fault(spec, env, "shm_fs")


register_preparer(prepare)
register(Mechanism("disk_full", "storage", "none", disk_full,
                   "the disk tier's filesystem is full (ENOSPC) for for_s",
                   params={"for_s": (float, 8.0)}, recovers="none",
                   response=("persisting fails with tier_degraded and retries; "
                             "training goes on")))
register(Mechanism("exhaust_memory", "availability", "none", exhaust_memory,
                   "the keepers' shared memory is full (ENOSPC) for for_s",
                   params={"for_s": (float, 8.0)}, recovers="none",
                   response=("pre-allocated slots keep training going; a rank that "
                             "cannot get new slots skips its snapshots and trains "
                             "on until there is room")))
