"""The restore ladder with real keepers over real TCP and a real disk tier: a dead keeper or
a corrupted replica is refused with a logged reason and the next source is used; the state
applied is bit-identical to the original."""
from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import torch

from configs.errors import SnapshotNotFound
from runtime.keeper import Keeper
from runtime.keeper_wire import KeeperClient
from runtime.rejoin import restore_rank
from runtime.snapshot_format import checksums, make_manifest, plan_layout, write_into
from runtime.state_tree import flatten_state
from runtime.tier_disk import DiskTier

pytestmark = pytest.mark.integration


def snapshot_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: str, rank: int,
                step: int, secret: bytes) -> tuple[bytes, bytearray]:
    tensors, spec = flatten_state({"model": model, "optimizer": optimizer})
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job=job, rank=rank, step=step,
                             generation=0, tree_spec=spec, created_at=time.time()).sign(secret)
    return manifest.to_json(), buf


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def keeper_source(keeper: Keeper, node: str) -> dict:
    host, port = keeper.address
    return {"kind": "keeper", "node": node, "host": host, "port": port}


@pytest.mark.timeout(60)
def test_ladder_skips_a_dead_keeper_and_a_corrupted_replica(tmp_path: Path, caplog) -> None:
    secret, job = secrets.token_bytes(32), f"restore{secrets.token_hex(3)}"
    model, optimizer = trained()
    manifest, payload = snapshot_of(model, optimizer, job, rank=1, step=7, secret=secret)
    corrupted = bytearray(payload)
    corrupted[-5] ^= 0xFF
    disk = DiskTier(tmp_path, job)
    disk.write_rank(7, 1, memoryview(payload), manifest)
    disk.commit_step(7, [1])
    with Keeper("own", job, secret) as own, Keeper("replica", job, secret) as replica:
        replica.put_replica(1, 7, manifest, corrupted)
        dead = keeper_source(own, "own")
        sources = [dead, keeper_source(replica, "replica"),
                   {"kind": "tier", "tier": "disk", "path": str(tmp_path)}]
        own.close()  # the rank's own node is gone with its memory
        fresh_model, fresh_opt = trained()
        with torch.no_grad():
            for p in fresh_model.parameters():
                p.zero_()
        result = restore_rank({"model": fresh_model, "optimizer": fresh_opt}, 1, 7, sources,
                              job=job, secret=secret, timeout_s=2, generation=0)
    assert result.source == "tier disk"
    assert [name for name, _ in result.failures] == ["keeper own", "keeper replica"]
    assert "checksum" in result.failures[1][1]
    for want, got in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(want, got)
    state, fresh_state = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    for index in state:
        assert torch.equal(state[index]["exp_avg_sq"], fresh_state[index]["exp_avg_sq"])
    assert "restore_source_refused" in caplog.text


@pytest.mark.timeout(60)
def test_replica_keeper_serves_a_lost_nodes_rank_bit_identically() -> None:
    secret, job = secrets.token_bytes(32), f"restore{secrets.token_hex(3)}"
    model, optimizer = trained()
    manifest, payload = snapshot_of(model, optimizer, job, rank=3, step=4, secret=secret)
    with Keeper("holder", job, secret) as holder:
        holder.put_replica(3, 4, manifest, payload)
        with KeeperClient(*holder.address, secret, job) as client:
            assert client.get(3, 4)[2] == payload
        fresh_model, fresh_opt = trained()
        restore_rank({"model": fresh_model, "optimizer": fresh_opt}, 3, 4,
                     [keeper_source(holder, "holder")], job=job, secret=secret, timeout_s=2,
                     generation=0)
    for want, got in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(want, got)


@pytest.mark.timeout(60)
def test_no_verified_source_names_every_refusal() -> None:
    secret, job = secrets.token_bytes(32), f"restore{secrets.token_hex(3)}"
    model, optimizer = trained()
    manifest, payload = snapshot_of(model, optimizer, job, rank=0, step=2, secret=b"x" * 32)
    with Keeper("holder", job, secret) as holder:
        holder.put_replica(0, 2, manifest, payload)
        with pytest.raises(SnapshotNotFound, match="keeper holder: SnapshotUnauthenticated"):
            restore_rank({"model": model, "optimizer": optimizer}, 0, 2,
                         [keeper_source(holder, "holder")], job=job, secret=secret, timeout_s=2,
                         generation=0)
