"""Storage drill mechanisms act on a real disk tier holding a real verified snapshot: a
flipped bit, a truncated payload and a deleted checkpoint are each refused by the same
verification a restore runs; the mechanisms name what they damaged."""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from phalanx.configs.errors import ConfigError, SnapshotCorrupt
from phalanx.configs.loader import load_config
from phalanx.launcher.drills.catalogue import FaultSpec
from phalanx.launcher.drills.faults.storage import (corrupt_snapshot, delete_snapshot, flip_file,
                                                    truncate_snapshot)
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.format import verify_snapshot
from phalanx.runtime.snapshot.snapshotter import SnapshotPolicy, Snapshotter
from phalanx.runtime.tiers.disk import DiskTier
from phalanx.runtime.tiers.run_identity import run_id_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]
SECRET = b"s" * 32


def snapshot(job: str) -> tuple[bytes, bytes]:
    """(payload, manifest) of a real capture of a small model, signed with SECRET."""
    model = torch.nn.Linear(8, 4)
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1))
        try:
            snap.capture(1, {"model": model})
            snap.flush()
            reader = KeeperClient(*keeper.address, SECRET, job)
            _, manifest, payload = reader.get(0)
            reader.close()
        finally:
            snap.close()
            client.close()
    return bytes(payload), bytes(manifest)


class Env:
    def __init__(self, disk: Path, job: str) -> None:
        self.run_dir = disk
        self._cfg = load_config(str(ROOT / "configs" / "demo.yaml"),
                                [f"job.name={job}", f"tiers.disk.path={disk}"])

    def config(self) -> Any:
        return self._cfg

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        raise AssertionError("storage faults are not undone")


@pytest.fixture
def tier(tmp_path: Path) -> tuple[DiskTier, Env, bytes, bytes]:
    job = f"st{secrets.token_hex(3)}"
    payload, manifest = snapshot(job)
    disk = DiskTier(tmp_path, job, run_id=run_id_of(tmp_path))   # written by the drilled run
    for step in (10, 20):
        for rank in range(4):
            disk.write_rank(step, rank, payload, manifest)
        disk.commit_step(step, list(range(4)))
    return disk, Env(tmp_path, job), payload, manifest


def spec(kind: str, **params: Any) -> FaultSpec:
    return FaultSpec(kind, rank=1, at_step=5, params=params)


def test_corrupt_flips_one_bit_of_the_newest_tier_step_and_restore_refuses_it(tier) -> None:
    disk, env, payload, manifest = tier
    details = corrupt_snapshot(spec("corrupt_snapshot", where="disk", bit=3), env)
    assert details["step"] == 20
    damaged, same_manifest = disk.read_rank(20, 1)
    assert same_manifest == manifest and len(damaged) == len(payload)
    assert sum(a != b for a, b in zip(damaged, payload)) == 1
    with pytest.raises(SnapshotCorrupt):      # header or tensor checksum, by where it fell
        verify_snapshot(damaged, manifest, secret=SECRET, source="tier disk")
    verify_snapshot(disk.read_rank(10, 1)[0], manifest, secret=SECRET, source="older step")


def test_truncate_cuts_the_payload_and_restore_refuses_it(tier) -> None:
    disk, env, payload, manifest = tier
    details = truncate_snapshot(spec("truncate_snapshot", where="disk", keep_fraction=0.5), env)
    assert details == {"where": "disk", "step": 20, "bytes_before": len(payload),
                       "bytes_after": len(payload) // 2}
    with pytest.raises(SnapshotCorrupt):
        verify_snapshot(disk.read_rank(20, 1)[0], manifest, secret=SECRET, source="tier disk")


def test_delete_removes_the_newest_checkpoint(tier) -> None:
    disk, env, _, _ = tier
    assert delete_snapshot(spec("delete_snapshot", where="disk"), env)["step"] == 20
    assert disk.committed_steps() == [10]


def test_a_tier_fault_names_what_is_missing(tier, tmp_path: Path) -> None:
    _, env, _, _ = tier
    with pytest.raises(ConfigError, match="is not a tier"):
        truncate_snapshot(spec("truncate_snapshot", where="own", keep_fraction=0.5), env)
    empty = Env(tmp_path / "empty", "nothing")
    with pytest.raises(ConfigError, match="holds no complete step"):
        delete_snapshot(spec("delete_snapshot", where="disk"), empty)


def test_flip_file_changes_exactly_one_bit(tmp_path: Path) -> None:
    path = tmp_path / "slot"
    path.write_bytes(bytes(range(16)))
    assert flip_file(str(path), -1, bit=7) == 15
    data = path.read_bytes()
    assert data[:15] == bytes(range(15)) and data[15] == 15 ^ 0x80
