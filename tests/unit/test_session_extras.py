"""``Session.extras``: plain values the script updates during training are captured at each
snapshot and come back after a restore (a recovery's rollback, a replacement's start)."""
from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.runtime.context import WorkerContext
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.base import KeeperCopy, NodeId, TierCopy, source_to_json
from phalanx.runtime.snapshot.restore import TierSource, restore
from phalanx.runtime.worker.session import Session
from phalanx.runtime.snapshot.format import checksums, make_manifest, plan_layout, write_into
from phalanx.runtime.snapshot.state_tree import flatten_state
from phalanx.runtime.tiers.disk import DiskTier
from tests.fakes.tier_memory import MemoryTier

SECRET = secrets.token_bytes(32)


def standalone(job: str, **fields: Any) -> WorkerContext:
    """A one-rank context without group or etcd; keeps this process's torch thread count."""
    return WorkerContext(job=job, rank=0, world_size=1, secret_hex=SECRET.hex(),
                         torch_threads=torch.get_num_threads(), **fields)


def snapshot_to(tier: DiskTier | MemoryTier, job: str, objects: dict[str, Any],
                step: int) -> None:
    """What the snapshotter and persister do, synchronously: ``objects`` at ``step`` as a
    signed snapshot of rank 0, committed to ``tier``."""
    tensors, spec = flatten_state(objects)
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job=job, rank=0, step=step,
                             generation=0, tree_spec=spec, created_at=time.time()).sign(SECRET)
    tier.write_rank(step, 0, buf, manifest.to_json())
    tier.commit_step(step, [0])


def disk_source(root: Path) -> list[TierCopy]:
    return [TierCopy("disk", str(root))]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_restore_rebinds_and_returns_plain_values() -> None:
    tier = MemoryTier("extras-restore")
    snapshot_to(tier, "extras-restore", {"epoch": 5, "name": "warm"}, step=2)
    registered: dict[str, Any] = {"epoch": 0, "name": ""}
    result = restore(registered, 0, 2, [TierSource(tier)], SECRET, "extras-restore")
    assert result.values == {"epoch": 5, "name": "warm"} == registered


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_register_of_a_plain_value_makes_it_an_extra() -> None:
    session = Session(standalone("extras-reg"), capture_rng=False)
    model = torch.nn.Linear(2, 1)
    session.register(model=model, epoch=0)
    assert session.extras == {"epoch": 0}
    assert "epoch" not in session._objects and session._objects["model"] is model
    session.extras["epoch"] = 4                      # updates are what the snapshot sees
    tensors, spec = flatten_state(session._objects)
    items = dict((k, v) for k, v in spec["objects"]["__phalanx__"]["tree"]["items"])
    assert items["extras"] == {"t": "dict", "items": [["epoch", 4]]}
    for name in ("epoch", "model", "__x"):
        with pytest.raises(ValueError, match="already registered or reserved"):
            session.register(**{name: 1})


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_extras_come_back_after_apply_restore_and_at_a_replacements_start(
        tmp_path: Path) -> None:
    job = "extras-disk"
    session = Session(standalone(job), capture_rng=False)
    cursor, history = torch.arange(4.0), [1, 2]
    session.register(model=torch.nn.Linear(3, 2), history=history)
    session.extras.update(epoch=0, cursor=cursor, best=float("inf"))
    session._progress.step_index = 7
    session.extras.update(epoch=3, best=0.25, tag="warm")   # set during training
    snapshot_to(DiskTier(tmp_path, job), job, session._objects, step=7)
    extras = session.extras
    cursor.fill_(-1.0)
    history.append(3)
    session.extras.update(epoch=9, best=0.1, late="added after the snapshot")
    session._progress.step_index = 11

    session._apply_restore(7, disk_source(tmp_path), generation=1)

    assert session.extras is extras and session.step_index == 7
    assert set(extras) == {"epoch", "cursor", "best", "tag", "history"}
    assert (extras["epoch"], extras["best"], extras["tag"]) == (3, 0.25, "warm")
    assert extras["cursor"] is cursor and torch.equal(cursor, torch.arange(4.0))
    assert extras["history"] is history and history == [1, 2]
    assert session.generation == 1

    replacement = Session(standalone(job, extra={"restore": {
        "step": 7, "sources": [source_to_json(s) for s in disk_source(tmp_path)]}}),
        capture_rng=False)
    replacement.register(model=torch.nn.Linear(3, 2), history=[])
    replacement.extras.update(epoch=0, best=float("inf"))
    with replacement:
        assert replacement.step_index == 7
        assert replacement.extras["epoch"] == 3 and replacement.extras["best"] == 0.25
        assert replacement.extras["history"] == [1, 2]
        assert torch.equal(replacement.extras["cursor"], torch.arange(4.0))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_scalar_extra_set_during_training_is_restored_from_the_keeper() -> None:
    """Real steps snapshot into a real keeper; a rollback brings the extras of that step."""
    job = f"extras{secrets.token_hex(3)}"
    with Keeper("node0", job, SECRET) as keeper:
        host, port = keeper.address
        session = Session(standalone(job, keeper_host=host, keeper_port=port,
                                     snapshot_every="1"), capture_rng=False)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session.register(model=model, optimizer=optimizer, epoch=0)
        session.extras["seen"] = 0
        with session:
            while session.step_index < 6:
                with session.step() as step:
                    optimizer.zero_grad()
                    model(torch.randn(8, 4)).pow(2).mean().backward()
                    optimizer.step()
                    session.extras["epoch"] = step // 2
                    session.extras["seen"] += 8
            assert session._snapshotter is not None
            session._snapshotter.flush()
            want = {k: v.clone() for k, v in model.state_dict().items()}
            session.extras.update(epoch=99, seen=-1)         # a step that is rolled back
            with torch.no_grad():
                model.weight.zero_()
            session._apply_restore(6, [KeeperCopy(NodeId("node0"), host, port)], generation=0)
            assert session.step_index == 6
            assert session.extras == {"epoch": 2, "seen": 48}
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor, want[name]), name
