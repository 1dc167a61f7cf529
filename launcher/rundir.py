"""The run directory: one folder per launch holding the effective config, job.json (how to
reach the live job), rank logs, events and the disk tier; ``latest`` points at the newest."""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
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
        (path / "config.yaml").write_text(dump_config(cfg))
        (root / LATEST).write_text(str(path) + "\n")
        return cls(path)

    @classmethod
    def find(cls, run_dir: str | None, runs_root: str = ".phalanx/runs") -> "RunDir":
        """The named run directory, or the newest one under ``runs_root``."""
        if run_dir:
            path = Path(run_dir)
        else:
            latest = Path(runs_root) / LATEST
            if not latest.is_file():
                raise ConfigError("run_dir", f"no run found under {runs_root!r}",
                                  "launch a job first or pass its run directory")
            path = Path(latest.read_text().strip())
        if not (path / "job.json").is_file():
            raise ConfigError("run_dir", f"{str(path)!r} holds no job.json",
                              "pass a directory created by `phalanx launch`")
        return cls(path)

    def log_path(self, name: str) -> Path:
        return self.path / "logs" / f"{name}.log"

    def write_job(self, info: dict[str, Any]) -> None:
        tmp = self.path / "job.json.tmp"
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, self.path / "job.json")

    def read_job(self) -> dict[str, Any]:
        return json.loads((self.path / "job.json").read_text())
