"""Helpers to run ``phalanx launch`` as a real subprocess, the way a user does, and to
compute a job's fault-free result without phalanx."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.configs.loader import load_config

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
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "launch", str(ROOT / config),
           "--set", f"job.run_dir={run_root}"]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def launch(config: str, *overrides: str, run_root: Path, timeout_s: float = 240) -> LaunchResult:
    proc = subprocess.run(phalanx_command(config, *overrides, run_root=run_root), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})
    return LaunchResult(proc.returncode, proc.stdout, proc.stderr)


@dataclass
class Reference:
    """Fault-free final parameter hashes, per rank."""
    hashes: dict[int, str]


def gloo_reference(config: str, *overrides: str, run_root: Path,
                   timeout_s: float = 180) -> Reference:
    """The fault-free result of the config's ``examples/train_mlp.py`` job computed without
    phalanx: the same model, data, gloo all-reduce and optimizer under torchrun
    (``bench/torchrun_train.py``, no checkpoints, no sleeps), whose final parameters equal
    a fault-free phalanx run's bit for bit (``bench/vs_torchrun.py`` compares them every
    run). About 10 s where a ``phalanx launch`` takes 30-40 s."""
    cfg = load_config(str(ROOT / config), [*overrides, f"job.run_dir={run_root}"])
    assert cfg.job.entrypoint.endswith("train_mlp.py:main"), cfg.job.entrypoint
    args = {k: v for k, v in cfg.job.args.items() if k != "sleep_per_step_s"}
    key = (cfg.job.world_size, json.dumps(args, sort_keys=True))
    if key not in _REFERENCES:       # the same computation: once per test session
        _REFERENCES[key] = _torchrun_reference(cfg.job.world_size, args, run_root, timeout_s)
    return _REFERENCES[key]


_REFERENCES: dict[tuple[int, str], Reference] = {}


def _torchrun_reference(world_size: int, args: dict, run_root: Path,
                        timeout_s: float) -> Reference:
    progress = run_root / "gloo-reference"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           str(world_size), "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", str(ROOT / "bench" / "torchrun_train.py"), "--job", "mlp",
           "--job-args", json.dumps(args), "--ckpt-dir", str(progress / "checkpoints"),
           "--progress", str(progress)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hashes = {}
    for rank in range(world_size):
        for line in (progress / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["event"] == "done":
                hashes[rank] = record["hash"]
    assert len(hashes) == world_size, hashes
    return Reference(hashes)


def latest_run(run_root: Path) -> Path:
    """The run directory of the last launch under ``run_root``: a launch that Ray failed
    before its first step (``StartupLost``) is retried in a new run directory, so the first
    directory found need not be the one that trained."""
    return Path((run_root / "latest").read_text().strip())


def startup_lost(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a launch attempt the launcher retried (``StartupLost``)."""
    summary = run_dir / "summary.json"
    error = json.loads(summary.read_text()).get("error") if summary.is_file() else None
    return bool(error) and error.get("type") == "StartupLost"


def wait_training(run_root: Path, *, past_step: int, name: str | None = None,
                  proc: subprocess.Popen | None = None, timeout_s: float = 120) -> Path:
    """The run directory under ``run_root`` (of job ``name``, not an earlier run's) once
    every rank is past ``past_step`` (the slowest rank of its ``progress`` events); fails
    when ``proc`` (the launcher) ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, "the job ended before it trained"
        latest = run_root / "latest"
        if latest.is_file():
            run_dir = Path(latest.read_text().strip())
            events = run_dir / "events.jsonl"
            if (name is None or run_dir.name.startswith(f"{name}-")) and events.is_file():
                steps = [json.loads(line)["min_step"] for line in events.read_text().splitlines()
                         if '"progress"' in line]
                if steps and steps[-1] >= past_step:
                    return run_dir
        time.sleep(0.3)
    raise AssertionError("the job never started training")

