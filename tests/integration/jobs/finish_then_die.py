"""A data-parallel job whose rank ``die_rank`` is killed (SIGKILL, by itself) ``linger_s``
after its last step, once the other ranks have returned from this function: a fault after
some rank finished its loop."""
from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

import phalanx


def main(steps: int = 4, die_rank: int = 1, linger_s: float = 3.0, seed: int = 0) -> dict:
    session = phalanx.Session()
    torch.manual_seed(seed)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session.register(model=model, optimizer=optimizer)
    session.start()
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
    if session.rank == die_rank:
        time.sleep(linger_s)            # the other ranks return meanwhile
        print(f"rank {session.rank} dies at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    session.close()
    return {"loss": float(loss.detach())}
