"""Checks that refuse a job before it can fail later: the keeper's shared-memory room check
on ``alloc`` (no file is created when the slots cannot fit), and the S3 tier's launch check
(a missing bucket stops ``phalanx launch`` before any worker starts; a good bucket keeps no
probe object)."""
from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.configs.loader import load_config
from phalanx.configs.schema import S3TierConfig
from phalanx.runtime.keeper.daemon import Keeper, KeeperClient, owned_names
from phalanx.runtime.keeper.shm import ShmBuffer, mem_available
from tests.integration.launching import ROOT, launch
from tests.plugins.leaks import Footprint, assert_nothing_left
from tests.plugins.s3 import make_client

SECRET = b"launch-check-secret-0123456789ab"
_names = itertools.count()


# ------------------------------------------------------------ keeper: room before alloc

def _room(shm_dir: str) -> int:
    """What the keeper's check compares with: free bytes in shm_dir, and MemAvailable."""
    stat = os.statvfs(shm_dir)
    free = stat.f_bavail * stat.f_frsize
    available = mem_available()
    return free if available is None else min(free, available)


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails any shm file creation: a refused alloc must not even start allocating."""
    attempted: list[str] = []

    def refuse(path: str, nbytes: int) -> ShmBuffer:
        attempted.append(path)
        raise AssertionError(f"keeper tried to create {path} ({nbytes} bytes)")

    monkeypatch.setattr(ShmBuffer, "create", staticmethod(refuse))
    return attempted


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Keeper]:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    with Keeper("n0", f"lc{os.getpid()}-{next(_names)}", SECRET, str(shm_dir), slots=3) as k:
        yield k


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_keeper_alloc_refuses_a_state_larger_than_shm(keeper: Keeper,
                                                      no_allocation: list[str]) -> None:
    huge = 1 << 50
    with pytest.raises(ConfigError) as info:
        keeper.alloc(0, huge)
    error = info.value
    assert error.key == "snapshot.shm_dir"
    assert keeper.shm_dir in error.problem
    assert f"{3 * huge} bytes" in error.problem and "bytes free" in error.problem
    for fix in ("snapshot.shm_dir", "snapshot.slots", "snapshot.rank_size_mb", "smaller state"):
        assert fix in error.hint
    assert no_allocation == [] and os.listdir(keeper.shm_dir) == []
    assert keeper.holdings() == {} and keeper.stats()["files"] == 0


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_keeper_alloc_counts_every_slot_not_one(keeper: Keeper, no_allocation: list[str]) -> None:
    nbytes = _room(keeper.shm_dir) // 2  # one slot fits, three do not
    with pytest.raises(ConfigError, match="3 slots"):
        keeper.alloc(1, nbytes)
    assert no_allocation == [] and os.listdir(keeper.shm_dir) == []


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_keeper_alloc_within_room_creates_its_slots(keeper: Keeper) -> None:
    paths = keeper.alloc(0, 4096)
    assert len(paths) == 3 and all(os.path.getsize(p) == 4096 for p in paths)
    assert sorted(os.listdir(keeper.shm_dir)) == owned_names(keeper.shm_dir, keeper.prefix)


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_worker_sees_the_refusal_over_the_wire(keeper: Keeper, no_allocation: list[str]) -> None:
    with KeeperClient(*keeper.address, SECRET, keeper.job, timeout_s=10.0) as client:
        with pytest.raises(ConfigError) as info:
            client.alloc(0, 1 << 50)
    assert "snapshot.rank_size_mb" in str(info.value) and keeper.shm_dir in str(info.value)
    assert no_allocation == []


# ------------------------------------------------------------------ S3 launch check

def _s3_overrides(cfg: S3TierConfig, bucket: str) -> tuple[str, ...]:
    return ("tiers.s3.enabled=true", f"tiers.s3.bucket={bucket}",
            f"tiers.s3.endpoint_url={cfg.endpoint_url}", f"tiers.s3.region={cfg.region}")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_missing_bucket_refuses_launch_before_any_worker(s3_config: S3TierConfig,
                                                         tmp_path: Path,
                                                         footprint: Footprint) -> None:
    missing = f"phalanx-missing-{uuid.uuid4().hex[:12]}"
    result = launch("configs/demo.yaml", "job.world_size=2", "spares.count=0",
                    "job.args.steps=4", "job.args.sleep_per_step_s=0",
                    *_s3_overrides(s3_config, missing), run_root=tmp_path, timeout_s=90)
    assert result.returncode == 1, result.stdout + result.stderr
    assert missing in result.stderr and "tiers.s3.bucket" in result.stderr
    assert "final parameter hash" not in result.stdout
    assert not (tmp_path / "latest").exists(), "no run directory: nothing was started"
    assert list(tmp_path.iterdir()) == []
    assert make_client(s3_config.endpoint_url).list_objects_v2(
        Bucket=s3_config.bucket).get("KeyCount", 0) == 0
    assert_nothing_left(footprint, grace_s=2)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_launch_check_of_a_good_bucket_leaves_no_probe(s3_config: S3TierConfig,
                                                       tmp_path: Path) -> None:
    from phalanx.launcher.job import JobRunner  # imports Ray: only in the tests that need it

    cfg = load_config(str(ROOT / "configs/demo.yaml"),
                      [f"job.run_dir={tmp_path}", *_s3_overrides(s3_config, s3_config.bucket)])
    runner = JobRunner(cfg, base_dir=ROOT)
    runner._check_tiers()
    runner._check_tiers()
    client: Any = make_client(s3_config.endpoint_url)
    assert client.list_objects_v2(Bucket=s3_config.bucket).get("KeyCount", 0) == 0
