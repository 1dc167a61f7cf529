"""A data-parallel job whose loop does long work the stall detector must not take for a
hang: after step ``eval_at`` rank 0 runs an evaluation pass of ``eval_s`` outside
``session.step()`` while the other ranks wait for it in the next step's all-reduce, and
step ``busy_at`` holds a ``session.busy("save")`` block of ``busy_s`` on every rank."""
from __future__ import annotations

import time

import torch
from torch import nn

import phalanx


def main(steps: int = 10, eval_at: int = 3, eval_s: float = 3.0, busy_at: int = 6,
         busy_s: float = 3.0, seed: int = 0) -> dict:
    session = phalanx.Session()
    torch.manual_seed(seed)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session.register(model=model, optimizer=optimizer)
    evaluated = 0
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
                if step == busy_at:
                    with session.busy("save"):
                        time.sleep(busy_s)
            if session.step_index == eval_at + 1 and session.rank == 0 and not evaluated:
                evaluated += 1
                deadline = time.monotonic() + eval_s
                with torch.no_grad():
                    while time.monotonic() < deadline:     # forward-only, no collectives
                        model(torch.randn(64, 8))
                        time.sleep(0.01)
    return {"loss": float(loss.detach()), "evaluated": evaluated}
