"""A data-parallel job with BatchNorm and no SyncBatchNorm: gradients are all-reduced, so
parameters and optimizer state are identical on every rank, while each rank's running
statistics follow its own batches (per-rank state inside the replicated model).
``seeded=False`` initialises each rank differently and broadcasts nothing: replicas that
never agreed."""
from __future__ import annotations

import hashlib

import torch
from torch import nn

import phalanx


def main(steps: int = 30, seed: int = 0, seeded: bool = True) -> dict:
    session = phalanx.Session()
    torch.manual_seed(seed if seeded else seed + 1000 * (1 + session.rank))
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session.register(model=model, optimizer=optimizer)
    with session:
        while session.step_index < steps:
            with session.step() as step:
                gen = torch.Generator().manual_seed(seed * 7919 + session.rank * 104729 + step)
                x = torch.randn(16, 8, generator=gen) * (1 + session.rank)
                y = x.sum(dim=1, keepdim=True).sin()
                optimizer.zero_grad(set_to_none=False)
                nn.functional.mse_loss(model(x), y).backward()
                for p in model.parameters():
                    session.all_reduce(p.grad)
                    p.grad /= session.world_size
                optimizer.step()
    stats = model[1]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(f"rank {session.rank} final parameter hash {digest}", flush=True)
    return {"hash": digest, "running_mean": float(stats.running_mean.sum())}
