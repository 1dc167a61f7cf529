"""Deterministic data-parallel training of a small MLP on synthetic data.

Each rank draws its batch from a generator seeded by (seed, rank, step), so a run's result
depends only on its config; gradients are averaged with an all-reduce. Prints and returns
the sha256 of the concatenated final parameters.
"""
from __future__ import annotations

import hashlib
import json
import time

import torch
from torch import nn

import phalanx


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 1))


def batch(seed: int, rank: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(batch_size, 16, generator=gen)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def parameter_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(steps: int = 60, batch_size: int = 32, hidden: int = 64, lr: float = 0.05,
         seed: int = 0, sleep_per_step_s: float = 0.0, step_log: str = "") -> dict:
    """``step_log``: a path prefix; each rank then writes ``<prefix>.rank<r>.json`` with
    every step's wall time (snapshot capture included) and the steps a capture ended
    (``bench/replication.py`` reads it)."""
    session = phalanx.Session()
    model = make_model(hidden, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    session.register(model=model, optimizer=optimizer, scheduler=scheduler)
    with session:
        started = time.perf_counter()
        log: dict[str, list] = {"step_s": [], "captured": []}
        while session.step_index < steps:
            step_started = time.perf_counter()
            with session.step() as step:
                x, y = batch(seed, session.rank, step, batch_size)
                optimizer.zero_grad(set_to_none=False)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                for p in model.parameters():
                    session.all_reduce(p.grad)
                    p.grad /= session.world_size
                optimizer.step()
                scheduler.step()
                if sleep_per_step_s:
                    time.sleep(sleep_per_step_s)
            if step_log:
                log["step_s"].append(time.perf_counter() - step_started)
                stats = session.snapshot_stats
                if stats is not None and stats.last_capture_step == session.step_index:
                    log["captured"].append(len(log["step_s"]) - 1)
        seconds = time.perf_counter() - started
        digest = parameter_hash(model)
        stats, committed = session.snapshot_stats, session.committed_step
    print(f"rank {session.rank} trained {steps} steps in {seconds:.3f} s", flush=True)
    if stats is not None:
        print(f"rank {session.rank} snapshots {stats.captures} interval {stats.interval} "
              f"last stall {stats.last_stall_s * 1e3:.2f} ms committed step "
              f"{committed}", flush=True)
    print(f"rank {session.rank} final parameter hash {digest}", flush=True)
    if step_log:
        with open(f"{step_log}.rank{session.rank}.json", "w") as out:
            json.dump(log, out)
    return {"hash": digest, "steps": steps, "loss": float(loss.detach()), "seconds": seconds}


if __name__ == "__main__":
    main()
