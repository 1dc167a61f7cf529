"""Deterministic data-parallel training whose per-rank state is about ``state_mb`` MiB of
parameters (plus as much again of SGD momentum), for recovery benchmarks.

The model is a small input and output projection around a stack of ``width x width``
Linear layers (no bias) sized so that all parameters total about ``state_mb`` MiB. Compute
per step stays small whatever the state size: each step runs only ``ACTIVE`` of the big
layers (chosen by the step index, so replay after a rollback runs the same ones) on a small
batch; untouched layers get no gradient (``zero_grad(set_to_none=True)``), so the all-reduce
and the optimizer only touch the active layers. Momentum buffers exist for every parameter
from step 0 (created zeroed before the first snapshot), so the snapshot of every step holds
parameters + momentum, about twice ``state_mb``, and its size never changes.

Each rank draws its batch from a generator seeded by (seed, rank, step); gradients are
averaged with ``session.all_reduce``, one active parameter at a time: the one example that
keeps a hand-written all-reduce, because DDP would all-reduce every bucket of the whole
state each step (zeros for the idle layers) and the bench wants a big state with small
compute and traffic. Prints the measured snapshot size, the median wall time of a
step (snapshot included) and the sha256 of the final parameters, and returns them.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

import phalanx
from train_mlp import batch, parameter_hash  # a script's folder is importable, as with `python`

MiB = 1 << 20
MAX_WIDTH = 1024       # a 1024 x 1024 float32 layer is 4 MiB
ACTIVE = 2             # big layers each step runs
IN_FEATURES = 16       # what train_mlp.batch draws


class StateModel(nn.Module):
    """``layers`` big square layers between a small input and output projection."""

    def __init__(self, state_mb: float, seed: int) -> None:
        super().__init__()
        target = max(1, int(state_mb * MiB))
        width = max(8, min(MAX_WIDTH, int(math.sqrt(target / 4 / ACTIVE))))
        layers = max(ACTIVE, round(target / (width * width * 4)))
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN_FEATURES, width)
        self.out = nn.Linear(width, 1)
        self.big = nn.ModuleList(nn.Linear(width, width, bias=False, device="meta")
                                 for _ in range(layers))
        self.big.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(seed + 1)
        bound = 1.0 / math.sqrt(width)
        with torch.no_grad():  # uniform_ is several times cheaper than kaiming's init
            for layer in self.big:
                layer.weight.uniform_(-bound, bound, generator=gen)

    def active(self, step: int) -> list[int]:
        count = len(self.big)
        return sorted({(step * ACTIVE + i) % count for i in range(ACTIVE)})

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for index in self.active(step):
            h = torch.tanh(self.big[index](h))
        return self.out(h)


def main(steps: int = 30, state_mb: float = 64.0, seed: int = 0, sleep_per_step_s: float = 0.0,
         batch_size: int = 8, lr: float = 0.01) -> dict:
    session = phalanx.Session()
    model = StateModel(state_mb, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for p in model.parameters():  # momentum for every parameter from the first snapshot on
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    session.register(model=model, optimizer=optimizer)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    loss = torch.zeros(())
    step_times: list[float] = []
    with session:
        while session.step_index < steps:
            started = time.perf_counter()
            with session.step() as step:
                x, y = batch(seed, session.rank, step, batch_size)
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x, step), y)
                loss.backward()
                for p in model.parameters():
                    if p.grad is not None:
                        session.all_reduce(p.grad)
                        p.grad /= session.world_size
                optimizer.step()
                if sleep_per_step_s:
                    time.sleep(sleep_per_step_s)
            step_times.append(time.perf_counter() - started)
        digest = parameter_hash(model)
        stats = session.snapshot_stats
        snapshot_bytes = int(stats.bytes) if stats is not None else 0
    print(f"rank {session.rank} parameter bytes {params} snapshot bytes {snapshot_bytes} "
          f"big layers {len(model.big)} median step s {statistics.median(step_times or [0.0]):.4f}",
          flush=True)
    print(f"rank {session.rank} final parameter hash {digest}", flush=True)
    return {"hash": digest, "steps": steps, "loss": float(loss.detach()),
            "parameter_bytes": params, "snapshot_bytes": snapshot_bytes,
            "median_step_s": statistics.median(step_times or [0.0])}


if __name__ == "__main__":
    main()
