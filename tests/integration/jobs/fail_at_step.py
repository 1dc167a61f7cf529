"""A job whose rank ``fail_rank`` raises at step ``fail_step`` (launcher failure tests)."""
from __future__ import annotations

import torch

import phalanx


def main(steps: int = 20, fail_rank: int = 1, fail_step: int = 3) -> dict:
    session = phalanx.Session()
    value = torch.zeros(4)
    with session:
        while session.step_index < steps:
            with session.step() as step:
                if session.rank == fail_rank and step == fail_step:
                    raise ValueError(f"injected failure on rank {fail_rank} at step {step}")
                value += 1
                session.all_reduce(value)
    return {"value": float(value[0])}
