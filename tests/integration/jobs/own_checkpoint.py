"""A torchrun script that keeps its own checkpoint and no phalanx.Session, in the shape of
PyTorch's "Fault-tolerant distributed training with torchrun" tutorial
(ddp-tutorial-series/multigpu_torchrun.py, on CPU/gloo): rank 0 saves the model, the
optimizer and the next epoch after each epoch, and every rank loads that snapshot when it
starts, so a restart of every rank (torchrun's ``--max-restarts``; ``phalanx run`` of a
script without a Session) goes on from the last epoch saved. Rank 0 writes the sha256 of
the final parameters to ``--out``; each start prints the epoch it starts at."""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--load-s", type=float, default=0.0, help="each batch's loading time")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 32, generator=generator),
                         torch.randint(0, 4, (512,), generator=generator))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = 0
    if os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, map_location="cpu", weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first = snapshot["epoch"]
    print(f"rank {rank} starts at epoch {first} (restart "
          f"{os.environ['TORCHELASTIC_RESTART_COUNT']} of at most "
          f"{os.environ['TORCHELASTIC_MAX_RESTARTS']})", flush=True)
    ddp = DistributedDataParallel(model)
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            time.sleep(args.load_s)
            optimizer.zero_grad()
            F.cross_entropy(ddp(inputs), labels).backward()
            optimizer.step()
        if rank == 0:
            temporary = f"{args.snapshot}.tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1}, temporary)
            os.replace(temporary, args.snapshot)
    if rank == 0:
        digest = hashlib.sha256()
        for tensor in model.state_dict().values():
            digest.update(tensor.numpy().tobytes())
        with open(args.out, "w") as out:
            out.write(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
