#!/usr/bin/env python
"""One torchrun worker of ``bench/vs_torchrun.py``: the examples' training loop (the same
model, data, DistributedDataParallel and optimizer as ``examples/train_mlp.py`` and
``examples/train_transformer.py`` run under phalanx) with ``torch.distributed.checkpoint``
(DCP) saves every ``--every`` steps and resume from the newest complete one.

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d ... \\
        bench/torchrun_train.py --job mlp --job-args '{"steps": 100}' \\
        --ckpt-dir DIR --every 10 [--async-save] --progress DIR

Fair-baseline details (see ../shared/ENV-NOTES.md): the process group lives on
``PrefixStore(f"attempt{TORCHELASTIC_RESTART_COUNT}/", ...)`` so restarts form it cleanly;
the checkpoint is loaded before the first backward (or DCP silently skips Adam's state);
``async_save`` gets its own gloo group, each save waits for the previous one and the last is
waited for before exit; "newest checkpoint" = newest ``step_NNNNNN`` folder holding a
``.metadata`` file (a save cut short by the fault has none).

Each rank appends JSON lines to ``<progress>/rank<r>.jsonl``: ``start`` (pid, attempt,
seconds since the process started), ``resumed`` (the step it loaded, seconds), ``step``
(index, epoch end), ``saved`` (step, blocking seconds), ``done`` (parameter sha256).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

STARTED = time.time()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import train_mlp  # noqa: E402
import train_transformer  # noqa: E402


class Job:
    """Model, optimizer, optional scheduler and the loss of one step: exactly what the
    phalanx example of the same name computes."""

    def __init__(self, name: str, args: dict[str, Any],
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """``wrap``: the data-parallel wrapper (default torch's DDP; ``bench/torchft_train.py``
        passes torchft's)."""
        self.name, self.args = name, args
        self.scheduler: Any = None
        self.loss: Callable[[int, int], torch.Tensor]
        if name == "mlp":
            a = {"batch_size": 32, "hidden": 64, "lr": 0.05, "seed": 0, **args}
            self.model: nn.Module = train_mlp.make_model(a["hidden"], a["seed"])
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.model.parameters(), lr=a["lr"], momentum=0.9)
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=20,
                                                             gamma=0.5)

            def mlp_loss(rank: int, step: int) -> torch.Tensor:
                x, y = train_mlp.batch(a["seed"], rank, step, a["batch_size"])
                return nn.functional.mse_loss(self.model(x), y)
            self.loss = mlp_loss
        elif name == "transformer":
            a = {"batch_size": 2, "lr": 1e-3, "seed": 0, **train_transformer.DEFAULTS, **args}
            self.model = train_transformer.make_model(a["seed"], a["vocab"], a["d_model"],
                                                      a["layers"], a["heads"], a["seq_len"])
            self.optimizer = train_transformer.make_optimizer(self.model, a["lr"])

            def lm_loss(rank: int, step: int) -> torch.Tensor:
                tokens = train_transformer.batch(a["seed"], rank, step, a["batch_size"],
                                                 a["seq_len"], a["vocab"])
                return train_transformer.loss_of(self.model, tokens)
            self.loss = lm_loss
        else:
            raise SystemExit(f"--job {name!r}: expected mlp or transformer")
        # After the optimizer (the same parameter objects). find_unused_parameters: DDP then
        # keeps the bucket layout a phalanx job's DDP gets (its spares must join with the
        # survivors' layout); a rebuilt layout sums in another order (4 ranks)
        self.model = (wrap or _ddp)(self.model)
        self.steps = int(args.get("steps", 60))
        self.sleep_s = float(args.get("sleep_per_step_s", 0.0))

    def step(self, rank: int, step: int) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.loss(rank, step)
        if self.sleep_s:        # the slow model's compute: forward and backward
            time.sleep(self.sleep_s)
        loss.backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def state(self, step: int) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        extra = {"step": step,
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None}
        return {"model": model, "optim": optim, "extra": json.dumps(extra)}

    def load(self, path: Path) -> int:
        state = self.state(0)
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        extra = json.loads(state["extra"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        return int(extra["step"])


def _ddp(module: nn.Module) -> nn.Module:
    return DDP(module, find_unused_parameters=True)


def newest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step_*") if (p / ".metadata").exists())
    return done[-1] if done else None


def wait_saved(pending: Any) -> None:
    if pending is None:
        return
    future = getattr(pending, "upload_completion", pending)  # AsyncSaveResponse or Future
    future.result()


def progress_recorder(progress: Path, rank: int, attempt: int,
                      started: float) -> Callable[..., None]:
    """``record(event, **fields)``: one JSON line per event in ``<progress>/rank<r>.jsonl``
    (what ``bench/run_watch.py``'s ``Supervised`` reads); records ``start`` at once."""
    progress.mkdir(parents=True, exist_ok=True)
    out = open(progress / f"rank{rank}.jsonl", "a", buffering=1, encoding="utf-8")

    def record(event: str, **fields: Any) -> None:
        out.write(json.dumps({"event": event, "attempt": attempt, "t": time.time(),
                              **fields}) + "\n")

    record("start", pid=os.getpid(), since_exec_s=time.time() - started)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--job-args", default="{}")
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--every", type=int, default=0, help="save every K steps; 0 = never")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--progress", type=Path, required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)   # as phalanx's job.torch_threads default: same kernels, same bits
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = progress_recorder(args.progress, rank, attempt, STARTED)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store),
                            rank=rank, world_size=world)
    save_group = dist.new_group(backend="gloo") if args.async_save else None
    job = Job(args.job, json.loads(args.job_args))

    step = 0
    latest = newest_checkpoint(args.ckpt_dir) if args.every else None
    if latest is not None:
        began = time.time()
        step = job.load(latest)
        record("resumed", step=step, path=latest.name, seconds=time.time() - began)
    else:
        record("resumed", step=0, path=None, seconds=0.0)

    pending = None
    while step < job.steps:
        job.step(rank, step)
        step += 1
        record("step", step=step - 1)
        if args.every and step % args.every == 0 and step < job.steps:
            began = time.time()
            path = str(args.ckpt_dir / f"step_{step:06d}")
            if args.async_save:
                wait_saved(pending)
                pending = dcp.async_save(job.state(step), checkpoint_id=path,
                                         process_group=save_group)
            else:
                dcp.save(job.state(step), checkpoint_id=path)
            record("saved", step=step, seconds=time.time() - began)
    wait_saved(pending)
    record("done", hash=train_mlp.parameter_hash(job.model), step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
