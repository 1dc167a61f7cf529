"""Helpers to run ``phalanx launch`` as a real subprocess, the way a user does."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HASH_RE = re.compile(r"rank (\d+) final parameter hash ([0-9a-f]{64})")


@dataclass
class LaunchResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def hashes(self) -> dict[int, str]:
        return {int(rank): digest for rank, digest in HASH_RE.findall(self.stdout)}


def phalanx_command(config: str, *overrides: str, run_root: Path) -> list[str]:
    cmd = [sys.executable, "-m", "launcher.cli", "launch", str(ROOT / config),
           "--set", f"job.run_dir={run_root}"]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def launch(config: str, *overrides: str, run_root: Path, timeout_s: float = 240) -> LaunchResult:
    proc = subprocess.run(phalanx_command(config, *overrides, run_root=run_root), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})
    return LaunchResult(proc.returncode, proc.stdout, proc.stderr)
