"""Train the example MLP step after step (standalone rank 0) until killed; snapshots go to
the keeper named in PHALANX_CONTEXT. Used to show a keeper outlives its worker."""
from __future__ import annotations

import sys
import time

import torch

import phalanx
from examples.train_mlp import batch, make_model


def build(hidden: int = 64, seed: int = 0, lr: float = 0.05):
    model = make_model(hidden, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr / 10)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step: int, seed: int = 0) -> None:
    x, y = batch(seed, 0, step, 32)
    optimizer.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()


def main() -> None:
    torch.set_num_threads(1)
    model, optimizer, scheduler = build()
    session = phalanx.Session(capture_rng=False)
    session.register(model=model, optimizer=optimizer, scheduler=scheduler)
    with session:
        while True:
            with session.step() as step:
                train_step(model, optimizer, scheduler, step)
            print(f"step {session.step_index}", flush=True)
            time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
