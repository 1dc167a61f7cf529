"""``phalanx launch --resume`` after a total loss (issue 17, item 1): a run killed entirely
after a disk checkpoint, relaunched with ``--resume latest``, ends bit-identical to the
uninterrupted run; the resume is reported; the earlier run's checkpoint survives the new
run's retention; a checkpoint of another world size or with a tampered file is refused
with ``ResumeRefused`` before anything starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from phalanx.configs.errors import ResumeRefused
from phalanx.configs.loader import load_config
from phalanx.launcher.resume import find_resume_point
from tests.integration.launching import ROOT, LaunchResult, gloo_reference, latest_run, phalanx_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CONFIG = "configs/demo.yaml"
STEPS = 60


def _overrides(tier: Path, sleep_s: float = 0.05) -> tuple[str, ...]:
    """The job (its result does not depend on ``sleep_s``: run 1 is slow, so the kill
    lands long before its last step even on a loaded machine)."""
    return ("job.world_size=2", "spares.count=0", f"job.args.steps={STEPS}",
            f"job.args.sleep_per_step_s={sleep_s}", "tiers.disk.every_steps=10",
            "snapshot.every_steps=1",   # tiers persist full snapshots: one every step
            "tiers.disk.keep=1", f"tiers.disk.path={tier}")


def _wait_commit(tier: Path, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(tier.glob("demo/step_*/COMMIT")):
        assert proc.poll() is None, "run 1 ended before its first disk checkpoint"
        assert time.monotonic() < deadline, "no disk checkpoint committed in time"
        time.sleep(0.1)


def _session(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _kill_session(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGKILL every process of the launcher's session (it started one of its own)."""
    deadline = time.monotonic() + timeout_s
    while pids := _session(proc.pid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.poll()
        assert time.monotonic() < deadline, f"processes of run 1 survive: {pids}"
        time.sleep(0.2)
    proc.wait(timeout=30)


def _events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_resume_latest_after_a_total_loss_is_bit_identical(tmp_path: Path) -> None:
    tier, runs = tmp_path / "tier", tmp_path / "runs"
    overrides = _overrides(tier)
    reference = gloo_reference(CONFIG, *overrides, run_root=tmp_path / "ref")
    first = subprocess.Popen(phalanx_command(CONFIG, *_overrides(tier, 0.3), run_root=runs),
                             cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})
    try:
        _wait_commit(tier, first)
    finally:
        _kill_session(first)                  # launcher, Ray, keepers, workers: a total loss
    run1 = latest_run(runs)
    proc = subprocess.run([*phalanx_command(CONFIG, *overrides, run_root=runs), "--resume"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    run2 = latest_run(runs)
    assert run2 != run1
    [resumed] = _events(run2, "resumed_from")
    step = resumed["step"]
    assert resumed["run_id"] == run1.name and resumed["tier"] == "disk" and 10 <= step < STEPS
    assert _events(run2, "recovered") == []                 # resumed, not restarted
    assert f"resuming from step {step} of run {run1.name}" in " ".join(proc.stderr.split())
    assert json.loads((run2 / "summary.json").read_text())["resumed_from"]["step"] == step
    hashes = LaunchResult(proc.returncode, proc.stdout, proc.stderr).hashes
    assert hashes == reference.hashes                       # bit-identical to uninterrupted
    # run 1's checkpoint survived run 2's retention (keep 1); run 2's markers are its own
    marker = json.loads((tier / "demo" / f"step_{step:012d}" / "COMMIT").read_bytes())
    assert marker["run"] == run1.name
    own = [json.loads(p.read_bytes()) for p in tier.glob("demo/step_*/COMMIT")]
    assert {m["run"] for m in own} == {run1.name, run2.name}, own

    # a checkpoint that does not fit this launch is refused before anything starts
    wider = load_config(str(ROOT / CONFIG), [*overrides, "job.world_size=4",
                                             f"job.run_dir={runs}"])
    with pytest.raises(ResumeRefused, match=rf"step {step} of run {run1.name} .* holds 2 ranks "
                       r"but this launch has job.world_size 4"):
        find_resume_point(wider, str(step))
    same = load_config(str(ROOT / CONFIG), [*overrides, f"job.run_dir={runs}"])
    assert find_resume_point(same, str(step)).checkpoint.run == run1.name
    payload = tier / "demo" / f"step_{step:012d}" / "rank_1.safetensors"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(ResumeRefused, match=rf"step {step} of run {run1.name} .* rank 1 is "
                       r"corrupt: .*checksum mismatch"):
        find_resume_point(same, str(step))
