"""The job's shared-memory plan (``phalanx.runtime.keeper.memory_plan``): its arithmetic,
the keeper's check of it at a rank's first snapshot against a real small tmpfs (refused
with the sizes and the fix, or an alert with ``snapshot.allow_unprotected``), and the
status line of degraded protection."""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from rich.console import Console

from phalanx.configs.errors import ConfigError
from phalanx.configs.loader import load_config
from phalanx.runtime.keeper.daemon import Keeper, KeeperClient
from phalanx.runtime.keeper.memory_plan import (MemoryPlan, MemoryPlanExceeded, check_config_plan,
                                                job_bytes_held)
from phalanx.runtime.keeper.shm import reserve_file
from phalanx.launcher.status import ended_document, protection
from phalanx.launcher.status_view import protection_line, render_status
from tests.plugins.small_tmpfs import small_tmpfs

SECRET = b"memory-plan-secret-0123456789abc"
ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
_names = itertools.count()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[str]:
    with small_tmpfs(tmp_path / "shm", 8) as folder:
        yield folder


def _plan(**kw: Any) -> MemoryPlan:
    return MemoryPlan(**{"world_size": 4, "nodes": 2, "slots": 3, "copies": 1,
                         "shared_nodes": 2, **kw})


@pytest.mark.unit
def test_plan_counts_slots_and_replicas_of_every_node_sharing_the_tmpfs() -> None:
    plan = _plan()
    # per node: 2 ranks x 3 slots + 2 replicated ranks x (2 kept + 1 receiving)
    assert plan.node_bytes(100) == 100 * (2 * 3 + 2 * 3)
    assert plan.tmpfs_bytes(100) == 2 * plan.node_bytes(100)
    assert _plan(copies=0).tmpfs_bytes(100) == 2 * 100 * 2 * 3
    assert "2 node(s)" in plan.describe(100) and f"{plan.tmpfs_bytes(100)} bytes" in plan.describe(100)
    assert "one copy per node" in plan.describe(100)


@pytest.mark.unit
def test_plan_from_config_shares_the_tmpfs_only_with_an_embedded_ray(tmp_path: Path) -> None:
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [f"job.run_dir={tmp_path}"])
    assert MemoryPlan.from_config(cfg) == _plan()
    joined = load_config(str(ROOT / "configs/demo.yaml"),
                         [f"job.run_dir={tmp_path}", "ray.address=10.0.0.1:6379",
                          "replication.enabled=false"])
    assert MemoryPlan.from_config(joined) == _plan(shared_nodes=1, copies=0)


@pytest.mark.unit
def test_start_up_check_uses_the_same_plan(tmp_path: Path, tmpfs: str) -> None:
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        f"job.run_dir={tmp_path}", f"snapshot.shm_dir={tmpfs}", "snapshot.rank_size_mb=1"])
    with pytest.raises(MemoryPlanExceeded) as info:     # 24 MiB planned, 8 MiB there
        check_config_plan(cfg)
    assert f"{MemoryPlan.from_config(cfg).tmpfs_bytes(MIB)} bytes" in info.value.problem
    check_config_plan(load_config(str(ROOT / "configs/demo.yaml"), [
        f"job.run_dir={tmp_path}", f"snapshot.shm_dir={tmpfs}", "snapshot.rank_size_mb=0.25"]))


def _keeper(shm_dir: str, **kw: Any) -> Keeper:
    return Keeper("n0", f"mp{os.getpid()}-{next(_names)}", SECRET, shm_dir, slots=3,
                  plan=_plan(world_size=2, nodes=2), **kw)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_first_snapshot_beyond_the_plan_is_refused_with_sizes_and_fix(tmpfs: str) -> None:
    nbytes = MIB     # 3 slots fit the 8 MiB tmpfs; the plan (2 nodes x 6 buffers) does not
    with _keeper(tmpfs) as keeper, KeeperClient(*keeper.address, SECRET, keeper.job,
                                                timeout_s=10.0) as client:
        with pytest.raises(MemoryPlanExceeded) as info:      # over the wire, typed
            client.alloc(0, nbytes)
        text = str(info.value)
        assert info.value.key == "snapshot.shm_dir"
        assert f"measured {nbytes} bytes" in text and f"{12 * nbytes} bytes" in text
        assert "bytes free" in text and tmpfs in text
        for fix in ("--shm-size", "snapshot.allow_unprotected: true", "snapshot.slots"):
            assert fix in info.value.hint
        assert os.listdir(tmpfs) == [] and keeper.holdings() == {}
        assert len(client.alloc(0, nbytes // 4)) == 3       # a plan that fits is served


def _fill(folder: str) -> Path:
    """A file that takes every free byte of the tmpfs ``folder`` (ENOSPC reached)."""
    filler = Path(folder) / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (256 << 10))
                fh.flush()
        except OSError:
            pass
    return filler


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_after_a_recovery_a_rank_without_room_trains_on_alerted_until_there_is_room(
        tmpfs: str) -> None:
    """The plan held at generation 0; a promoted rank that finds the tmpfs full later (the
    capacity drill) is refused plainly (the worker skips its snapshots and asks again), one
    alert per rank, and an all-clear once it has slots: the job is not failed."""
    events: list[dict[str, Any]] = []
    small = MIB // 4                 # the plan: 12 x 256 KiB = 3 MiB of the 8 MiB tmpfs
    with _keeper(tmpfs, on_event=events.append) as keeper:
        keeper.alloc(0, small)
        filler = _fill(tmpfs)
        with pytest.raises(MemoryPlanExceeded):          # generation 0: the plan is unproven
            keeper.alloc(1, small)
        keeper.plan_proven()                             # the job recovered (generation 1)
        for _ in range(2):
            with pytest.raises(ConfigError) as info:
                keeper.alloc(1, small)
            assert not isinstance(info.value, MemoryPlanExceeded)
        assert [(e["event"], e["rank"]) for e in events] == [("snapshot_unprotected", 1)]
        assert "trains on without snapshots" in events[0]["reason"]
        assert protection([{**e, "node": "node0"} for e in events])["state"] == "degraded"
        filler.unlink()
        assert len(keeper.alloc(1, small)) == 3
        assert [e["event"] for e in events] == ["snapshot_unprotected", "snapshot_protected"]
        assert protection([{**e, "node": "node0"} for e in events]) == {"state": "full"}


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_allow_unprotected_alerts_and_keeps_the_slots_that_fit(tmpfs: str) -> None:
    events: list[dict[str, Any]] = []
    with _keeper(tmpfs, allow_unprotected=True, on_event=events.append) as keeper:
        paths = keeper.alloc(0, MIB)
        assert len(paths) == 3 and all(os.path.exists(p) for p in paths)
        assert [e["event"] for e in events] == ["snapshot_unprotected"]
        assert events[0]["rank"] == 0 and events[0]["plan_bytes"] == 12 * MIB
        assert "degraded protection" in events[0]["reason"]
        assert job_bytes_held(tmpfs, keeper.job) == 0      # pages come as the worker writes
        for path in paths:
            reserve_file(path, MIB)
        assert job_bytes_held(tmpfs, keeper.job) == 3 * MIB
        with pytest.raises(ConfigError) as info:     # slots that do not fit: refused, plain
            keeper.alloc(1, 4 * MIB)
        assert not isinstance(info.value, MemoryPlanExceeded)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_files_already_held_by_the_job_count_towards_the_plan(tmpfs: str) -> None:
    # plan 12 x 600 KiB = 7.0 MiB of 8: after rank 0's 3 slots only 6.2 MiB are free, but
    # 1.8 MiB of the plan is then held: rank 1's first snapshot still fits the plan
    nbytes = 600 << 10
    with _keeper(tmpfs) as keeper:
        for path in keeper.alloc(0, nbytes):     # written: their pages are held
            reserve_file(path, nbytes)
        for path in keeper.alloc(1, nbytes):
            reserve_file(path, nbytes)
        assert job_bytes_held(tmpfs, keeper.job) == 6 * nbytes
        assert job_bytes_held(tmpfs, keeper.job + "x") == 0


@pytest.mark.unit
def test_status_shows_degraded_protection_only_after_the_alert(tmp_path: Path) -> None:
    alert = {"event": "snapshot_unprotected", "node": "node1", "rank": 1, "time": 1.0,
             "reason": "keeper node1: rank 1's first snapshot measured 9 bytes; ..."}
    assert protection([{"event": "phase", "to": "steady"}]) == {"state": "full"}
    assert protection_line(protection([])) is None
    state = protection([alert])
    assert state["state"] == "degraded" and state["nodes"] == ["node1"] and state["ranks"] == [1]
    doc = ended_document({"job": "demo"}, tmp_path, {"outcome": "finished", "steps": 4}, [alert])
    console = Console(record=True, width=300)
    render_status(doc, console)
    text = console.export_text()
    assert "snapshot protection: DEGRADED on node1 (ranks 1): keeper node1" in text
