"""A worker's snapshots live in its node keeper: SIGKILL the worker, the keeper still
serves its newest step, checksums and HMAC verify, and the state is bit-identical."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.runtime.context import WorkerContext
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.format import Manifest, read_tensors
from phalanx.runtime.snapshot.state_tree import apply_state
from tests.integration.jobs.train_forever import build, train_step

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def wait_for_step(client: KeeperClient, rank: int, step: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        latest = client.latest(rank)
        if latest is not None and latest >= step:
            return latest
        time.sleep(0.05)
    raise AssertionError(f"keeper never held step {step} of rank {rank}")


@pytest.mark.timeout(120)
def test_keeper_serves_last_step_after_worker_sigkill() -> None:
    secret = secrets.token_bytes(32)
    job = f"snap{secrets.token_hex(3)}"
    with Keeper("node0", job, secret) as keeper:
        host, port = keeper.address
        ctx = WorkerContext(job=job, rank=0, world_size=1, node="node0", keeper_host=host,
                            keeper_port=port, secret_hex=secret.hex(), snapshot_every="1")
        env = {**os.environ, **ctx.to_env(), "PYTHONPATH": str(ROOT)}
        worker = subprocess.Popen([sys.executable, "-m", "tests.integration.jobs.train_forever"],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            with KeeperClient(host, port, secret, job) as client:
                wait_for_step(client, 0, 6, timeout_s=60)
                worker.send_signal(signal.SIGKILL)
                worker.wait(timeout=10)
                step, manifest_bytes, payload = client.get(0)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert worker.returncode == -signal.SIGKILL
        manifest = Manifest.from_json(manifest_bytes, source="keeper node0")
        manifest.verify(secret, source="keeper node0")
        assert manifest.step == step and manifest.rank == 0
        tensors = read_tensors(memoryview(payload)[:manifest.total_bytes], verify_against=manifest)

        model, optimizer, scheduler = build()
        for s in range(step):
            train_step(model, optimizer, scheduler, s)
        fresh_model, fresh_opt, fresh_sched = build(seed=1)
        from phalanx.runtime.worker.session import _Progress
        progress = _Progress()
        apply_state({"__phalanx__": progress, "model": fresh_model, "optimizer": fresh_opt,
                     "scheduler": fresh_sched}, tensors, manifest.tree_spec)
        assert progress.step_index == step
        for want, got in zip(model.parameters(), fresh_model.parameters()):
            assert torch.equal(want, got)
        want_state, got_state = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
        for index in want_state:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(want_state[index][key], got_state[index][key])
        assert scheduler.state_dict() == fresh_sched.state_dict()
        assert keeper.stats()["local_bytes"] > 0
    assert not [name for name in os.listdir("/dev/shm") if job in name]
