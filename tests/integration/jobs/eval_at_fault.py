"""A data-parallel job where rank ``eval_rank`` runs an evaluation pass of ``eval_s`` with
no collectives (outside ``session.step()``) after step ``eval_at``, so a fault injected at
step ``eval_at + 1`` starts a new generation while that rank is busy elsewhere."""
from __future__ import annotations

import time

import torch
from torch import nn

import phalanx


def main(steps: int = 8, eval_at: int = 3, eval_s: float = 40.0, eval_rank: int = 0,
         seed: int = 0) -> dict:
    session = phalanx.Session()
    torch.manual_seed(seed)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session.register(model=model, optimizer=optimizer)
    with session:
        while session.step_index < steps:
            with session.step() as step:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + session.rank * 10_007 + step)
                x = torch.randn(16, 8, generator=gen)
                loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                optimizer.zero_grad()
                loss.backward()
                for p in model.parameters():
                    session.all_reduce(p.grad)
                    p.grad /= session.world_size
                optimizer.step()
            if session.step_index == eval_at + 1 and session.rank == eval_rank:
                deadline = time.monotonic() + eval_s
                with torch.no_grad():
                    while time.monotonic() < deadline:     # forward-only, no collectives
                        model(torch.randn(64, 8))
                        time.sleep(0.05)
    return {"loss": float(loss.detach())}
