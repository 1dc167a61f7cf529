"""Deterministic data-parallel training of a small MLP on synthetic data.

Each rank draws its batch from a generator seeded by (seed, rank, step), so a run's result
depends only on its config. The script's own ``init_process_group()`` and
``DistributedDataParallel`` average the gradients, as under torchrun; phalanx re-forms that
group in place after a fault. Prints and returns the sha256 of the concatenated final
parameters.
"""
from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import phalanx
if __package__:              # imported as examples.train_mlp (the tests)
    from .step_log import StepLog
else:                        # run as a script: its folder is importable, as with `python`
    from step_log import StepLog


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
    every step's wall time and end (see ``step_log.py``; the benches read it)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    session = phalanx.Session()
    model = DDP(make_model(hidden, seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    session.register(model=model, optimizer=optimizer, scheduler=scheduler)
    loss = torch.zeros(())        # a run resumed at its last step trains no step
    with session:
        started = time.perf_counter()
        log = StepLog(step_log)
        while session.step_index < steps:
            log.begin()
            with session.step() as step:
                x, y = batch(seed, session.rank, step, batch_size)
                optimizer.zero_grad(set_to_none=False)
                loss = nn.functional.mse_loss(model(x), y)
                if sleep_per_step_s:    # the slow model's compute: forward and backward
                    time.sleep(sleep_per_step_s)
                loss.backward()
                optimizer.step()
                scheduler.step()
            log.end(session, step)
        seconds = time.perf_counter() - started
        digest = parameter_hash(model)
        stats, committed = session.snapshot_stats, session.committed_step
    print(f"rank {session.rank} trained {steps} steps in {seconds:.3f} s", flush=True)
    if stats is not None:
        print(f"rank {session.rank} snapshots {stats.captures} interval {stats.interval} "
              f"last stall {stats.last_stall_s * 1e3:.2f} ms committed step "
              f"{committed}", flush=True)
    print(f"rank {session.rank} final parameter hash {digest}", flush=True)
    log.write(session.rank)
    return {"hash": digest, "steps": steps, "loss": float(loss.detach()), "seconds": seconds}


if __name__ == "__main__":
    main()
