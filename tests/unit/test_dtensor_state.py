"""FSDP2 state in snapshots (runtime/snapshot/dtensor.py): a DTensor is captured as this
rank's local shard plus its placement metadata in the JSON tree spec, restored into the
live shards on the same mesh, and refused (named errors) on another mesh or placement.

The meshes run on torch's in-process ``fake`` process group (one rank of a larger world,
collectives are no-ops): the encoding is pure logic over a mesh's shape and this rank's
coordinate. Real gloo FSDP2 jobs: tests/integration/test_fsdp.py."""
from __future__ import annotations

import itertools
import json
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from phalanx.configs.errors import (FatalError, PlacementUnsupported, ReshardUnsupported,
                                    SnapshotCorrupt)
from phalanx.runtime.consistency.digest import replica_digest
from phalanx.runtime.snapshot.dtensor import replica_group
from phalanx.runtime.snapshot.state_classes import OptimizerStateOf, ParamsOf, classify
from phalanx.runtime.snapshot.state_tree import apply_state, flatten_state, unflatten_state
from tests.unit.test_state_tree import capture, restore

pytestmark = pytest.mark.unit
_WORLDS = itertools.count()


@contextmanager
def fake_world(rank: int, world: int, replicate: int = 1) -> Iterator[Any]:
    """This process as ``rank`` of ``world`` (fake collectives); yields a 1-D "dp" mesh, or
    with ``replicate`` > 1 a 2-D (replicate, shard) mesh (HSDP)."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    # a new dim name per world: FSDP2 reuses an earlier mesh equal by value (same shape and
    # names), with that world's coordinate; a real process has one world
    n = next(_WORLDS)
    try:
        if replicate > 1:
            yield init_device_mesh("cpu", (replicate, world // replicate),
                                   mesh_dim_names=(f"rep{n}", f"shard{n}"))
        else:
            yield init_device_mesh("cpu", (world,), mesh_dim_names=(f"dp{n}",))
    finally:
        dist.destroy_process_group()


def sharded_job(mesh: Any, steps: int = 1) -> dict[str, Any]:
    """A fully_shard-ed MLP (rows 5 and 1: uneven and empty shards) and its Adam, after
    ``steps`` optimizer steps on fixed gradients (local DTensor ops only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    advance(model, optimizer, steps)
    return {"model": model, "optimizer": optimizer}


def advance(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.25 * (i + 1))
        optimizer.step()


def local_bytes(objects: dict[str, Any]) -> dict[str, bytes]:
    tensors, _ = flatten_state(objects)
    return {k: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for k, t in tensors.items()}


def node(spec: dict, obj: str, key: Any) -> dict:
    items = spec["objects"][obj]["tree"]["items"]
    return dict((k, v) for k, v in items)[key]


def test_fsdp2_state_is_captured_as_local_shards_with_placement_metadata() -> None:
    with fake_world(1, 2) as mesh:
        objects = sharded_job(mesh)
        tensors, spec = flatten_state(objects)
        assert json.loads(json.dumps(spec)) == spec           # plain JSON, no pickle
        weight = node(spec, "model", "0.weight")
        assert weight == {"t": "dtensor", "name": "model/0.weight",
                          "mesh": {"device": "cpu", "shape": [2],
                                   "dims": list(mesh.mesh_dim_names), "ranks": [0, 1]},
                          "placements": [{"shard": 0}], "shape": [5, 4], "stride": [4, 1],
                          "coord": [1]}
        # rank 1's shards: rows 3..4 of 5, and no row of the 1-row layer: never gathered
        assert all(type(t) is torch.Tensor for t in tensors.values())
        assert tensors["model/0.weight"].shape == (2, 4)
        assert tensors["model/2.weight"].shape == (0, 5)
        live = objects["model"][0].weight.to_local()
        assert torch.equal(tensors["model/0.weight"], live)
        first = dict(dict(node(spec, "optimizer", "state")["items"])[0]["items"])
        assert first["exp_avg"]["t"] == "dtensor" and first["step"]["t"] == "tensor"
        assert first["exp_avg"]["placements"] == [{"shard": 0}]
        assert first["exp_avg"]["coord"] == [1]


def test_a_restore_on_the_same_rank_copies_into_the_live_shards() -> None:
    with fake_world(1, 2) as mesh:
        objects = sharded_job(mesh)
        payload, manifest = capture(objects)
        captured = local_bytes(objects)
        model, optimizer = objects["model"], objects["optimizer"]
        shards = [p.to_local().data_ptr() for p in model.parameters()]
        moments = [optimizer.state[p]["exp_avg"].to_local().data_ptr()
                   for p in model.parameters() if p.numel()]
        advance(model, optimizer, 2)
        assert local_bytes(objects) != captured
        restore(objects, payload, manifest)
        assert local_bytes(objects) == captured
        assert [p.to_local().data_ptr() for p in model.parameters()] == shards
        for p in model.parameters():
            state = optimizer.state[p]["exp_avg"]
            assert isinstance(state, DTensor) and state.placements == (Shard(0),)
            assert state.device_mesh is p.device_mesh and state.shape == p.shape
        # the optimizer's live moments were copied into, not replaced by fresh memory
        assert [optimizer.state[p]["exp_avg"].to_local().data_ptr()
                for p in model.parameters() if p.numel()] == moments


def test_a_replacement_rank_rebuilds_sharded_optimizer_state_it_never_had() -> None:
    """A promoted spare's optimizer holds no state yet: its DTensors are rebuilt on the
    live mesh (found through the model's parameters) and train on bit for bit."""
    with fake_world(0, 2) as mesh:
        survivor = sharded_job(mesh, steps=3)
        payload, manifest = capture(survivor)
        spare = sharded_job(mesh, steps=0)
        assert not spare["optimizer"].state
        restore(spare, payload, manifest)
        assert local_bytes(spare) == local_bytes(survivor)
        advance(survivor["model"], survivor["optimizer"], 2)
        advance(spare["model"], spare["optimizer"], 2)
        assert local_bytes(spare) == local_bytes(survivor)


def test_a_restore_onto_another_world_size_is_refused_naming_both_meshes() -> None:
    with fake_world(0, 2) as mesh:
        payload, manifest = capture(sharded_job(mesh))
        (old,) = mesh.mesh_dim_names
    with fake_world(0, 4) as mesh:
        objects = sharded_job(mesh, steps=0)
        with pytest.raises(ReshardUnsupported) as refused:
            restore(objects, payload, manifest)
        (new,) = mesh.mesh_dim_names
    text = str(refused.value)
    assert isinstance(refused.value, FatalError)
    assert f"'model/0.weight' was sharded over the cpu mesh (2,) dims ('{old}',) over ranks " \
        "[0, 1]" in text
    assert f"cpu mesh (4,) dims ('{new}',) over ranks [0, 1, 2, 3]" in text
    assert "same world size and mesh shape" in text and "DCP" in text


def test_a_restore_of_another_ranks_shards_is_refused() -> None:
    """Rank 0 given the snapshot of the rank at coordinate 1 of the same mesh."""
    with fake_world(0, 2) as mesh:
        objects = sharded_job(mesh)
        tensors, spec = flatten_state(objects)
        node(spec, "model", "0.weight")["coord"] = [1]
        with pytest.raises(ReshardUnsupported, match=r"coordinate \[1\] .* at \(0,\)"):
            apply_state(objects, {k: t.clone() for k, t in tensors.items()}, spec)


def test_a_partial_placement_is_refused_at_the_first_capture() -> None:
    with fake_world(0, 2) as mesh:
        pending = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
        with pytest.raises(PlacementUnsupported) as refused:
            flatten_state({**sharded_job(mesh), "sums": {"pending": pending}})
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, FatalError)
    assert "'sums/pending'" in str(refused.value) and "Partial" in str(refused.value)
    assert "Shard(dim) and Replicate()" in str(refused.value)


def test_a_shard_that_does_not_fit_its_placement_is_corrupt() -> None:
    with fake_world(0, 2) as mesh:
        objects = sharded_job(mesh)
        tensors, spec = flatten_state(objects)
        weight = node(spec, "model", "0.weight")
        weight["shape"] = [9, 4]                      # rank 0 would hold 5 rows, not 3
        with pytest.raises(SnapshotCorrupt, match="model/0.weight.*local shard of shape"):
            apply_state(objects, {k: t.clone() for k, t in tensors.items()}, spec)


def test_unflatten_gives_the_plain_local_shards() -> None:
    with fake_world(1, 2) as mesh:
        tensors, spec = flatten_state(sharded_job(mesh))
    tree = unflatten_state(tensors, spec)
    weight = tree["model"]["0.weight"]
    assert type(weight) is torch.Tensor and weight.shape == (2, 4)


def test_the_replica_digest_leaves_shards_out_and_still_sees_replicated_state() -> None:
    """``detection.compare_replicas`` on an FSDP2 job: two ranks hold different shards at
    different mesh coordinates, yet their digests agree; a replicated tensor (Adam's
    ``step``, a plain tensor) that differs still makes them differ."""
    with fake_world(1, 2) as mesh:
        tensors, spec = flatten_state(sharded_job(mesh))
    sums = {name: f"xxh3:{hash(t.numpy().tobytes()) & 0xffff:x}" for name, t in tensors.items()}
    sharded = {n for n in sums if n.startswith("model/")} | {
        n for n in sums if n.startswith("optimizer/") and "exp_avg" in n}
    assert "model/0.weight" in sharded and len(sharded) >= 8
    other = json.loads(json.dumps(spec).replace('"coord": [1]', '"coord": [0]'))
    assert other != spec
    other_sums = {n: ("xxh3:0" if n in sharded else s) for n, s in sums.items()}
    names = ("model", "optimizer")
    digest = replica_digest(sums, spec, names)
    assert digest is not None and replica_digest(other_sums, other, names) == digest
    plain = next(n for n in sums if n not in sharded and n.startswith("optimizer/"))
    assert replica_digest({**other_sums, plain: "xxh3:bad"}, other, names) != digest


def test_hsdp_shards_are_replicated_over_the_replicate_dimension() -> None:
    """A 2 x 2 (replicate, shard) mesh over ranks [[0, 1], [2, 3]]: rank 1 holds the same
    shards as rank 3, so its model and optimizer are replicated over (1, 3) and heal from
    rank 3's live copy; a 1-D mesh's shards are each rank's own (sharded)."""
    with fake_world(1, 4, replicate=2) as mesh:
        objects = sharded_job(mesh)
        weight = objects["model"][0].weight
        assert [type(p).__name__ for p in weight.placements] == ["Replicate", "Shard"]
        assert replica_group(weight) == (1, 3)
        classes = classify(objects)
        assert classes.kinds == {"model": "replicated", "optimizer": "split"}
        assert classes.group == (1, 3)
        assert isinstance(classes.replicated["model"], ParamsOf)
        assert isinstance(classes.replicated["optimizer"], OptimizerStateOf)
        assert "replica_group=[1, 3]" in classes.describe()
    with fake_world(1, 2) as mesh:
        objects = sharded_job(mesh)
        assert replica_group(objects["model"][0].weight) == (1,)
        classes = classify(objects)
        assert classes.kinds == {"model": "sharded", "optimizer": "sharded"}
        assert not classes.split and classes.group == ()


def test_a_replicas_shards_apply_on_the_rank_it_is_replicated_with() -> None:
    """Rank 1 given the shards of rank 3 (coordinate [1, 1]; rank 1 is at [0, 1]): the same
    shards by their placements, applied (a heal from the live replica). Those of rank 0
    (coordinate [0, 0], the other half) are refused."""
    with fake_world(1, 4, replicate=2) as mesh:
        objects = sharded_job(mesh, steps=2)
        tensors, spec = flatten_state(objects)
        assert node(spec, "model", "0.weight")["coord"] == [0, 1]
        for obj in ("model", "optimizer"):
            for item in _dtensor_nodes(spec["objects"][obj]):
                item["coord"] = [1, 1]
        fresh = sharded_job(mesh, steps=0)
        apply_state(fresh, {k: t.clone() for k, t in tensors.items()}, spec)
        assert local_bytes(fresh) == local_bytes(objects)
        node(spec, "model", "0.weight")["coord"] = [0, 0]
        with pytest.raises(ReshardUnsupported, match=r"coordinate \[0, 0\] .* at \(0, 1\)"):
            apply_state(fresh, {k: t.clone() for k, t in tensors.items()}, spec)


def _dtensor_nodes(tree: Any) -> Iterator[dict]:
    if isinstance(tree, list):
        for item in tree:
            yield from _dtensor_nodes(item)
    elif isinstance(tree, dict):
        if tree.get("t") == "dtensor":
            yield tree
        for value in tree.values():
            yield from _dtensor_nodes(value)
