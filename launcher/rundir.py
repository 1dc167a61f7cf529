"""The run directory: one folder per launch holding the effective config, job.json (how to
reach the live job), rank logs, events and the disk tier; ``latest`` points at the newest."""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from phalanx.configs.errors import ConfigError
from phalanx.configs.loader import dump_config
from phalanx.configs.schema import PhalanxConfig

LATEST = "latest"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, cfg: PhalanxConfig) -> "RunDir":
        root = Path(cfg.job.run_dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = (root / f"{cfg.job.name}-{stamp}-{secrets.token_hex(2)}").resolve()
        (path / "logs").mkdir(parents=True)
        (path / "config.yaml").write_text(dump_config(saved_config(cfg, path)))
        (root / LATEST).write_text(str(path) + "\n")
        return cls(path)

    def config_text(self) -> str:
        """The run's saved ``config.yaml``, which workers get in their context: a machine
        that does not share this filesystem cannot read it. "" when it cannot be read (a
        standby on another machine): workers then read the file themselves."""
        try:
            return (self.path / "config.yaml").read_text(encoding="utf-8")
        except OSError:
            return ""

    @classmethod
    def find(cls, run_dir: str | None, runs_root: str = ".phalanx/runs",
             source: str = "phalanx status") -> "RunDir":
        """The named run directory, or the newest one under ``runs_root``; raises
        ConfigError (``source``: the command) when there is none."""
        if run_dir:
            path = Path(run_dir)
        else:
            latest = Path(runs_root) / LATEST
            if not latest.is_file():
                where = "" if Path(runs_root).is_absolute() else f" (in {Path.cwd()})"
                raise ConfigError("run_dir", f"no run found under {runs_root!r}{where}",
                                  "pass the run directory `phalanx launch` printed, or run "
                                  "this where you launched from", source)
            path = Path(latest.read_text().strip())
        if not path.is_dir():
            raise ConfigError("run_dir", f"{str(path)!r} does not exist",
                              "pass the run directory `phalanx launch` printed (under "
                              "job.run_dir)", source)
        if not (path / "job.json").is_file():
            raise ConfigError("run_dir", f"{str(path)!r} holds no job.json",
                              "pass a directory created by `phalanx launch`", source)
        return cls(path)

    @staticmethod
    def of_config(config_file: str | os.PathLike[str]) -> "RunDir | None":
        """The run directory a config file was saved in (``<run>/config.yaml`` beside a
        ``job.json``), else None."""
        folder = Path(config_file).resolve().parent
        return RunDir(folder) if (folder / "job.json").is_file() else None

    def log_path(self, name: str) -> Path:
        return self.path / "logs" / f"{name}.log"

    def write_job(self, info: dict[str, Any]) -> None:
        tmp = self.path / "job.json.tmp"
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, self.path / "job.json")

    def read_job(self) -> dict[str, Any]:
        return json.loads((self.path / "job.json").read_text())


def saved_config(cfg: PhalanxConfig, run_path: Path) -> PhalanxConfig:
    """The config as a run saves it: ``tiers.disk.path`` made absolute, and an empty one
    (``<run dir>/checkpoints``) written out, so ``phalanx ckpt --config <run>/config.yaml``
    finds this run's checkpoints and no other's."""
    disk = cfg.tiers.disk
    path = Path(disk.path).resolve() if disk.path else run_path / "checkpoints"
    return replace(cfg, tiers=replace(cfg.tiers, disk=replace(disk, path=str(path))))
