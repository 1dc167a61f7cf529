"""A process SIGKILLed while DiskTier writes a large step: no partial step is visible as
committed or readable, and a later write of the same step or the next one succeeds, with
the dead writer's temp file ignored and swept by retention."""
from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from phalanx.configs.errors import SnapshotNotFound
from phalanx.launcher.ckpt_commands import add_ckpt_parser, run_ckpt
from phalanx.runtime.snapshot.format import checksums, make_manifest, plan_layout, write_into
from phalanx.runtime.tiers.disk import DiskTier

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
JOB = "crash-job"
SECRET = b"crash-test-secret"
CHUNK = 16 * 1024 * 1024            # DiskTier's largest write(2) call
LARGE = 8 * CHUNK

# The writer: rank 0 of step 2 (small), then rank 1 (LARGE bytes) on a slow disk: every
# write(2) call sleeps first, so the test can kill it part-way through rank 1's payload.
WRITER = """
import os, sys, time
from pathlib import Path
from phalanx.runtime.tiers.disk import DiskTier

root, large = Path(sys.argv[1]), int(sys.argv[2])
real_write = os.write
def slow_write(fd, data):
    time.sleep(0.25)
    return real_write(fd, data)
os.write = slow_write
tier = DiskTier(root, "crash-job")
tier.write_rank(2, 0, b"small", b"{}")
tier.write_rank(2, 1, bytearray(large), b"{}")
tier.commit_step(2, [0, 1])
print("committed", flush=True)
"""


def signed_rank(step: int, rank: int) -> tuple[bytearray, bytes]:
    tensors = {"w": torch.arange(64, dtype=torch.float32) + step * 10 + rank}
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(buf, layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job=JOB, rank=rank, step=step,
                             generation=0, tree_spec={"version": 1, "objects": {}},
                             created_at=time.time()).sign(SECRET)
    return buf, manifest.to_json()


def write_step(tier: DiskTier, step: int) -> None:
    for rank in (0, 1):
        tier.write_rank(step, rank, *signed_rank(step, rank))
    tier.commit_step(step, [0, 1])


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.tmp"))


def ckpt(*argv: str) -> tuple[int, str]:
    """(exit code, --json or console text) of ``phalanx ckpt <argv>``."""
    parser = argparse.ArgumentParser()
    add_ckpt_parser(parser.add_subparsers(dest="command"))
    console_text, out = io.StringIO(), io.StringIO()
    code = run_ckpt(parser.parse_args(["ckpt", *argv]), Console(file=console_text, width=200),
                    out=out)
    return code, out.getvalue() or console_text.getvalue()


def listed(root: Path) -> dict[int, dict]:
    code, out = ckpt("ls", "--path", str(root), "--job", JOB, "--json")
    assert code == 0, out
    return {s["step"]: s for s in json.loads(out)["steps"]}


def kill_mid_write(root: Path) -> Path:
    """Run the writer until rank 1's temp file holds two chunks, SIGKILL it; the temp file."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(LARGE)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    step_dir = root / JOB / "step_000000000002"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            temps = list(step_dir.glob(".rank_1.safetensors.*.tmp")) if step_dir.is_dir() else []
            if temps and temps[0].stat().st_size >= 2 * CHUNK:
                break
            assert writer.poll() is None, writer.communicate()
            time.sleep(0.01)
        else:
            raise AssertionError("the writer never got part-way through rank 1's payload")
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(timeout=10)
    assert writer.returncode == -signal.SIGKILL
    (temp,) = temps
    assert 2 * CHUNK <= temp.stat().st_size < LARGE    # really cut off mid-write
    return temp


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then_write", ["same_step", "next_step"])
def test_sigkill_mid_write_leaves_no_visible_step(tmp_path: Path, then_write: str) -> None:
    tier = DiskTier(tmp_path, JOB)
    write_step(tier, 1)
    temp = kill_mid_write(tmp_path)

    assert tier.committed_steps() == [1]
    with pytest.raises(SnapshotNotFound, match="step 2 rank 1"):
        tier.read_rank(2, 1)
    steps = listed(tmp_path)
    assert steps[1]["state"] == "committed"
    assert steps[2]["state"] == "partial" and steps[2]["ranks"] == [0]
    assert 1 not in steps[2]["ranks"]

    if then_write == "same_step":       # the step is written again, in full
        write_step(tier, 2)
        assert not temp.exists()        # the rewrite of rank 1 dropped the dead writer's temp
        assert tier.committed_steps() == [1, 2]
        assert tier.read_rank(2, 1)[0] == bytes(signed_rank(2, 1)[0])
        steps = listed(tmp_path)
        assert steps[2]["state"] == "committed" and steps[2]["ranks"] == [0, 1]
        files = [p for p in tier.step_dir(2).iterdir() if p.name.startswith("rank_")]
        assert steps[2]["total_bytes"] == sum(p.stat().st_size for p in files)  # temp not counted
        secret_file = tmp_path / "secret"
        secret_file.write_bytes(SECRET)
        code, text = ckpt("verify", "--path", str(tmp_path), "--job", JOB, "--step", "2",
                          "--secret-file", str(secret_file))
        assert code == 0 and "2/2 ranks OK" in text, text
        write_step(tier, 3)
        assert tier.apply_retention(1) == [1, 2]
    else:                               # training moved on: the partial step is swept
        write_step(tier, 3)
        assert tier.committed_steps() == [1, 3]
        assert tier.apply_retention(2) == [2]
        assert tier.committed_steps() == [1, 3]
    assert not temp.exists() and temp_files(tmp_path) == []
    assert not tier.step_dir(2).exists()
