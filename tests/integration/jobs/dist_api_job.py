"""A script-mode job (run as __main__) that trains a DDP model through a drilled fault, then
uses the default process group's API surface and torch.distributed.checkpoint on it, and
writes what it saw to ``<out>.rank<r>`` (tests/integration/test_default_group_job.py)."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group()                       # env://, gloo: phalanx's default group
rank, world = dist.get_rank(), dist.get_world_size()
world_group = dist.group.WORLD
torch.manual_seed(0)
model = DDP(nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
session = phalanx.Session()
session.register(model=model, optimizer=optimizer)
with session:
    while session.step_index < args.steps:
        with session.step() as step:
            x = torch.full((8, 4), float(step + rank))
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            time.sleep(0.05)

    # after the recovery, on the same default group object
    seen = {"pid": os.getpid(), "recoveries": session.recoveries,
            "generation": session.generation, "same_world": dist.group.WORLD is world_group,
            "backend": dist.get_backend(), "rank": dist.get_rank(), "world": dist.get_world_size()}
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    seen["all_reduce"] = summed.item()
    sent = torch.tensor([float(rank * 10)])
    dist.broadcast(sent, src=world - 1)
    seen["broadcast"] = sent.item()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    seen["all_gather"] = [g.item() for g in gathered]
    objects: list = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    seen["all_gather_object"] = objects
    dist.barrier()
    sampler = DistributedSampler(list(range(10)))
    seen["sampler"] = [sampler.num_replicas, sampler.rank]
    # DCP on the default group, into the job's tiers (the <job>.dcp namespace)
    state = {"model": model.state_dict()}
    dcp.save(state, storage_writer=phalanx.TieredStorageWriter.from_config(None, 100))
    dcp.async_save(state, storage_writer=phalanx.TieredStorageWriter.from_config(None, 101)).result()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(loaded, storage_reader=phalanx.TieredStorageReader.from_config(None, 101))
    seen["dcp_round_trip"] = all(torch.equal(loaded["model"][k], v)
                                 for k, v in model.state_dict().items())
with open(f"{args.out}.rank{rank}", "w") as f:
    json.dump(seen, f)
