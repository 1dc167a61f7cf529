"""FSDP2 on CPU, made fault tolerant: ``fully_shard`` over a gloo ``DeviceMesh`` (each rank
holds a shard of every parameter and of Adam's state, as ``DTensor`` local shards), a
deterministic batch per (seed, rank, step), a ``phalanx.Session`` around the loop. The
same script runs under torchrun (the Session then snapshots nothing):

    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 40 --out /tmp/fsdp
    phalanx run --nnodes 2 --spares 1 examples/train_fsdp.py --steps 40 --out /tmp/fsdp
    phalanx drill run configs/drills/kill_node.yaml --config configs/fsdp.yaml --verify

With ``--replicate N`` the mesh is 2-D (HSDP): parameters are sharded within groups of
world/N ranks and replicated across N such groups.

Each rank's snapshot holds its local shards with their placement metadata
(runtime/snapshot/dtensor.py); a replacement rank restores them into its own shards.
Writes ``OUT.rank<r>``: the sha256 of the rank's final local shards (docs/porting.md).
"""
import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import phalanx


class MLP(nn.Module):
    """A few layers, each one FSDP unit (its own all-gather in forward, reduce-scatter in
    backward)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def batch(seed: int, rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(size, 16, generator=gen)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def shard_hash(model: nn.Module) -> str:
    """sha256 of this rank's local shards (the parameters it owns), in parameter order."""
    digest = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(local.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicate", type=int, default=1,
                        help="HSDP: shard within groups of world/REPLICATE ranks, replicate "
                             "across REPLICATE such groups (a 2-D mesh)")
    parser.add_argument("--mesh-only", action="store_true",
                        help="no init_process_group of the script's own: init_device_mesh "
                             "makes the default group itself (the DTensor and "
                             "tensor-parallel tutorials' shape)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--out", default="", help="write the final hash to OUT.rank<r>")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if not args.mesh_only:      # else init_device_mesh makes the default group itself
        dist.init_process_group("gloo")
    world = int(os.environ["WORLD_SIZE"])       # torchrun's (and phalanx's) environment
    if args.replicate > 1:      # HSDP: the mesh's dimensions are groups made by new_group
        mesh = init_device_mesh("cpu", (args.replicate, world // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    torch.manual_seed(args.seed)                # every rank builds the same full model
    model = MLP(args.width, args.depth)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    session = phalanx.Session()
    session.register(model=model, optimizer=optimizer)
    loss = torch.zeros(())
    with session:
        while session.step_index < args.steps:
            with session.step() as step:
                x, y = batch(args.seed, rank, step, args.batch_size)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                time.sleep(args.sleep)
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
    digest = shard_hash(model)
    print(f"rank {rank} final parameter hash {digest}", flush=True)
    if args.out:
        with open(f"{args.out}.rank{rank}", "w") as f:
            f.write(digest)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
