"""The restore ladder with real keepers over real TCP and a real disk tier: a dead keeper or
a corrupted replica is refused with a logged reason and the next source is used; the state
applied is bit-identical to the original."""
from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import pytest
import torch

from phalanx.runtime.base import KeeperCopy, NodeId, TierCopy
from phalanx.configs.errors import SnapshotNotFound
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.worker.rejoin import restore_rank
from phalanx.runtime.snapshot.format import checksums, make_manifest, plan_layout, write_into
from phalanx.runtime.snapshot.state_tree import flatten_state
from phalanx.runtime.tiers.disk import DiskTier

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


def keeper_source(keeper: Keeper, node: str) -> KeeperCopy:
    host, port = keeper.address
    return KeeperCopy(NodeId(node), host, port)


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
                   TierCopy("disk", str(tmp_path))]
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


def _planted(model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: str, rank: int,
             step: int, how: str, secret: bytes) -> tuple[bytes, bytearray]:
    """A snapshot with a valid layout written by someone else: another job's secret, no
    HMAC at all, or this job's HMAC over bytes that rotted afterwards."""
    if how == "other secret":
        return snapshot_of(model, optimizer, job, rank, step, secret=b"o" * 32)
    tensors, spec = flatten_state({"model": model, "optimizer": optimizer})
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job=job, rank=rank, step=step,
                             generation=0, tree_spec=spec, created_at=time.time())
    if how == "no hmac":
        return manifest.to_json(), buf
    buf[-3] ^= 0x10                     # the last tensor's bytes, after signing
    return manifest.sign(secret).to_json(), buf


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how,error,detail", [
    ("other secret", "SnapshotUnauthenticated", "HMAC does not match the job secret"),
    ("no hmac", "SnapshotUnauthenticated", "manifest is unsigned"),
    ("rotted byte", "SnapshotCorrupt", "checksum mismatch"),
])
def test_a_planted_s3_object_is_refused_and_restore_falls_to_the_next_tier(
        s3_config, tmp_path: Path, how: str, error: str, detail: str) -> None:
    from phalanx.runtime.snapshot.restore import TierSource, restore
    from phalanx.runtime.tiers.s3 import S3Tier

    secret, job = secrets.token_bytes(32), f"planted{secrets.token_hex(3)}"
    model, optimizer = trained()
    s3 = S3Tier(s3_config, job)
    s3.write_rank(5, 2, *_planted(model, optimizer, job, 2, 5, how, secret)[::-1])
    s3.commit_step(5, [2])
    good_manifest, good_payload = snapshot_of(model, optimizer, job, rank=2, step=5,
                                              secret=secret)
    disk = DiskTier(tmp_path, job)
    disk.write_rank(5, 2, memoryview(good_payload), good_manifest)
    disk.commit_step(5, [2])

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    objects = {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters(), lr=0.01)}
    result = restore(objects, 2, 5, [TierSource(s3), TierSource(disk)], secret, job)

    assert result.source == "tier disk"
    (name, why), = result.failures
    key = f"s3://{s3_config.bucket}/phalanx/{job}/step_000000000005/rank_2.safetensors"
    assert name == "tier s3" and why.startswith(f"{error}: tier s3 rank 2 step 5 ({key}")
    assert detail in why
    if error == "SnapshotCorrupt":
        assert re.search(r"tensor '[^']+exp_avg_sq' checksum mismatch", why)  # names it
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(SnapshotNotFound, match=f"tier s3: {error}: tier s3 rank 2 step 5"):
        restore(objects, 2, 5, [TierSource(s3)], secret, job)
