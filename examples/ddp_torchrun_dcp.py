"""examples/ddp_torchrun.py made restartable the usual way, for comparison (docs/porting.md):
torch.distributed.checkpoint every --ckpt-every steps with the DataLoader's position
(torchdata's StatefulDataLoader), and a resume from the newest checkpoint when torchrun
restarts the job:

    torchrun --nproc-per-node 2 --max-restarts 3 examples/ddp_torchrun_dcp.py --ckpt-dir ck

A restart redoes the steps since the last checkpoint and restarts every rank.
"""
import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader as DataLoader


class Regression(Dataset):
    """Synthetic samples with random noise drawn when a sample is loaded (augmentation)."""

    def __init__(self, size, seed):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 16, generator=gen)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(16), self.y[i]


def make_model(batchnorm):
    norm = nn.BatchNorm1d(64) if batchnorm else nn.Identity()
    return nn.Sequential(nn.Linear(16, 64), norm, nn.Tanh(), nn.Linear(64, 1))


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--out", default="", help="write the final hash to OUT.rank<r>")
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--ckpt-every", type=int, default=10)
    return parser.parse_args()


def evaluate(model, loader):
    model.eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for x, y in loader:
            total += torch.stack([nn.functional.mse_loss(model(x), y, reduction="sum"),
                                  torch.tensor(float(len(x)))])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def finish(model, out):
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(f"rank {dist.get_rank()} final parameter hash {digest}", flush=True)
    if out:
        with open(f"{out}.rank{dist.get_rank()}", "w") as f:
            f.write(digest)


def save(args, step, epoch, model, optimizer, scheduler, loader):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
             "loader": loader.state_dict(), "epoch": epoch, "step": step,
             "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{step}",
                                               f"rank_{dist.get_rank()}"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.ckpt_dir, "latest"), "w") as f:
            f.write(str(step))


def resume(args, model, optimizer, scheduler, loader):
    latest = os.path.join(args.ckpt_dir, "latest")
    if not os.path.exists(latest):
        return 0, 0
    with open(latest) as f:
        step = int(f.read())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
             "loader": loader.state_dict(), "epoch": 0, "step": 0, "rng": torch.get_rng_state()}
    dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{step}",
                                               f"rank_{dist.get_rank()}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    return state["epoch"], state["step"]


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = Regression(args.samples, seed=1)
    sampler = DistributedSampler(data, shuffle=True, seed=2)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    test_loader = DataLoader(Regression(64, seed=3), batch_size=32)
    model = DDP(make_model(args.batchnorm))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    start_epoch, step = resume(args, model, optimizer, scheduler, loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            time.sleep(args.sleep)
            step += 1
            if step % args.ckpt_every == 0:
                save(args, step, epoch, model, optimizer, scheduler, loader)
        scheduler.step()
        test_loss = evaluate(model, test_loader)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} test loss {test_loss:.5f}", flush=True)
    finish(model, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
