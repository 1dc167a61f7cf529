"""A torchrun-style DDP training script (CPU/gloo), as people write it: init_process_group,
DistributedDataParallel, a DataLoader over a DistributedSampler with shuffling and worker
processes, an epoch loop with an evaluation pass. It knows nothing about phalanx:

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --epochs 3
    phalanx run --nnodes 2 --nproc-per-node 1 examples/ddp_torchrun.py --epochs 3

Both print (and with ``--out PREFIX`` write to ``PREFIX.rank<r>``) the sha256 of the final
parameters. ``examples/ddp_phalanx.py`` is the same job made fault tolerant.
"""
import argparse
import contextlib
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset,
                              get_worker_info)


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


class Stream(IterableDataset):
    """A streaming dataset, as large-corpus scripts read shards: each rank of a data-parallel
    group, and each loader worker of a rank, reads its own slice of a per-epoch shuffled
    order (``set_epoch``); a sample's noise is drawn where it is loaded."""

    def __init__(self, size, rank, ranks):
        self.size, self.rank, self.ranks, self.epoch = size, rank, ranks, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        worker = get_worker_info()
        index, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist()[self.rank::self.ranks][index::workers]:
            x = torch.randn(16, generator=torch.Generator().manual_seed(i))
            yield x + 0.01 * torch.randn(16), torch.sin(x.sum()).reshape(1)


def make_model(batchnorm, dropout=0.0):
    norm = nn.BatchNorm1d(64) if batchnorm else nn.Identity()
    drop = [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(nn.Linear(16, 64), norm, nn.Tanh(), *drop, nn.Linear(64, 1))


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--persistent-workers", action="store_true",
                        help="keep the loader's worker processes from one epoch to the next")
    parser.add_argument("--zero", action="store_true",
                        help="shard the optimizer state over the ranks (ZeroRedundancyOptimizer)")
    parser.add_argument("--dist-url", default="env://",
                        help="init_process_group's init_method, such as "
                             "tcp://{MASTER_ADDR}:{MASTER_PORT} (read from the environment)")
    parser.add_argument("--eval-first", action="store_true",
                        help="evaluate at each epoch's top too (the loss it starts from)")
    parser.add_argument("--epoch-barrier", action="store_true",
                        help="a barrier and an all-reduce at each epoch's top, as some "
                             "scripts have")
    parser.add_argument("--run-name", action="store_true",
                        help="rank 0 names the run and broadcasts the name "
                             "(broadcast_object_list), as scripts share a name, seed or config")
    parser.add_argument("--epoch-plan", action="store_true",
                        help="rank 0 sends each epoch's plan (its learning rate) to every "
                             "rank with broadcast_object_list at the epoch's top")
    parser.add_argument("--eval-group", action="store_true",
                        help="the evaluation all-reduces over a group made by dist.new_group")
    parser.add_argument("--max-batches", type=int, default=0,
                        help="leave each epoch after this many batches (0: all)")
    parser.add_argument("--static-graph", action="store_true",
                        help="DDP(static_graph=True), as scripts with activation "
                             "checkpointing use")
    parser.add_argument("--ddp-groups", type=int, default=1,
                        help="split the ranks into this many data-parallel groups "
                             "(dist.new_group), each training a model of its own, as "
                             "pipeline stages or an ensemble do")
    parser.add_argument("--iterable", action="store_true",
                        help="read a streaming IterableDataset (sharded by rank and worker), "
                             "not a map-style dataset through a DistributedSampler")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="a dropout layer with this probability (masks from the RNG)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also evaluate after every this many batches, between two "
                             "steps, as scripts that validate within an epoch do")
    parser.add_argument("--accum", type=int, default=1,
                        help="accumulate gradients over this many micro-batches per "
                             "optimizer step, the first ones under DDP's no_sync()")
    parser.add_argument("--clip", type=float, default=0.0,
                        help="clip the gradients' norm to this (clip_grad_norm_; 0: off)")
    parser.add_argument("--autocast", action="store_true",
                        help="run the forward pass under torch.autocast (CPU, bfloat16)")
    parser.add_argument("--save-dir", default="",
                        help="rank 0 saves the model (and the optimizer, unless --zero) "
                             "with torch.save after each epoch, as scripts checkpoint")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--out", default="", help="write the final hash to OUT.rank<r>")
    return parser.parse_args()


def evaluate(model, loader, group=None):
    model.eval()
    total = torch.zeros(2)
    with torch.no_grad():
        for x, y in loader:
            total += torch.stack([nn.functional.mse_loss(model(x), y, reduction="sum"),
                                  torch.tensor(float(len(x)))])
    dist.all_reduce(total, group=group)
    model.train()
    return (total[0] / total[1]).item()


def train_step(model, x, y, args):
    """One optimizer step's gradients: ``args.accum`` micro-batches, all but the last under
    ``no_sync()`` (DDP all-reduces once per step), the forward under autocast if asked,
    the gradients clipped if asked."""
    micro = list(zip(x.chunk(args.accum), y.chunk(args.accum)))
    for k, (xs, ys) in enumerate(micro):
        sync = contextlib.nullcontext() if k == len(micro) - 1 else model.no_sync()
        with sync:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                out = model(xs)
            loss = nn.functional.mse_loss(out.float(), ys) / len(micro)
            loss.backward()
    if args.clip:
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)


def save(model, optimizer, epoch, args):
    """Rank 0's checkpoint of the epoch, written by the script itself (``--save-dir``)."""
    if args.save_dir and dist.get_rank() == 0:
        state = {"model": model.state_dict(), "epoch": epoch}
        if not args.zero:       # ZeRO's state_dict() is a collective over every rank
            state["optimizer"] = optimizer.state_dict()
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(state, os.path.join(args.save_dir, f"epoch{epoch}.pt"))


def finish(model, out):
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(f"rank {dist.get_rank()} final parameter hash {digest}", flush=True)
    if out:
        with open(f"{out}.rank{dist.get_rank()}", "w") as f:
            f.write(digest)


def main():
    args = parse_args()
    if args.dist_url == "env://":
        dist.init_process_group("gloo")
    else:       # a tcp:// rendezvous needs the rank and world size given
        dist.init_process_group("gloo", init_method=args.dist_url.format_map(os.environ),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    if args.run_name:
        name = [time.strftime("run-%Y%m%d-%H%M%S") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(name, src=0)
        print(f"rank {dist.get_rank()} run name {name[0]}", flush=True)
    eval_group = dist.new_group() if args.eval_group else None
    size = dist.get_world_size() // args.ddp_groups    # ranks per data-parallel group
    ddp_groups = [dist.new_group(list(range(g * size, (g + 1) * size)))
                  for g in range(args.ddp_groups)] if args.ddp_groups > 1 else [None]
    index = dist.get_rank() // size                     # this rank's group
    torch.manual_seed(index)
    data = Regression(args.samples, seed=1)
    sampler = DistributedSampler(data, num_replicas=size, rank=dist.get_rank() % size,
                                 shuffle=True, seed=2)
    if args.iterable:   # the stream shards itself; set_epoch reaches it as the sampler's would
        data = sampler = Stream(args.samples, dist.get_rank() % size, size)
    loader = DataLoader(data, batch_size=args.batch_size,
                        sampler=None if args.iterable else sampler,
                        num_workers=args.workers, persistent_workers=args.persistent_workers)
    test_loader = DataLoader(Regression(64, seed=3), batch_size=32)
    model = DDP(make_model(args.batchnorm, args.dropout), process_group=ddp_groups[index],
                static_graph=args.static_graph)
    if args.zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                            process_group=ddp_groups[index], lr=args.lr,
                                            momentum=0.9)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if args.eval_first:
            start_loss = evaluate(model, test_loader, eval_group)
            if dist.get_rank() == 0:
                print(f"epoch {epoch} starts at test loss {start_loss:.5f}", flush=True)
        if args.epoch_plan:
            plan = [{"epoch": epoch, "lr": scheduler.get_last_lr()[0]}
                    if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(plan, src=0)
            print(f"rank {dist.get_rank()} epoch {epoch} plan {plan[0]}", flush=True)
        if args.epoch_barrier:
            dist.barrier()                      # every rank starts the epoch together
            batches = torch.tensor([float(len(loader))])
            dist.all_reduce(batches)            # the job's batches in this epoch
        batch_size = len(next(iter(loader))[0])     # PyTorch's DDP tutorial peeks a batch
        for i, (x, y) in enumerate(loader):
            if args.max_batches and i >= args.max_batches:
                break
            optimizer.zero_grad()
            train_step(model, x, y, args)
            optimizer.step()
            time.sleep(args.sleep)
            if args.eval_every and (i + 1) % args.eval_every == 0:
                loss = evaluate(model, test_loader, eval_group)     # between two steps
                if dist.get_rank() == 0:
                    print(f"epoch {epoch} batch {i} test loss {loss:.5f}", flush=True)
        scheduler.step()
        save(model, optimizer, epoch, args)
        test_loss = evaluate(model, test_loader, eval_group)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} batch {batch_size} test loss {test_loss:.5f}", flush=True)
    finish(model, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
