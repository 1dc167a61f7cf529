"""DTensors in snapshots (FSDP2 parameters and their optimizer state): a DTensor is captured
as this rank's local shard plus its placement metadata in the tree spec, and rebuilt over
the live DeviceMesh at restore; never all-gathered, never merged with another rank's shard.

Spec node (``state_tree``'s grammar; ``name`` is the local shard's payload tensor)::

    {"t": "dtensor", "name": N,
     "mesh": {"device": "cpu", "shape": [2], "dims": ["dp"] | null, "ranks": [0, 1]},
     "placements": [{"shard": 0} | {"replicate": true}, ...],
     "shape": [64, 16], "stride": [16, 1], "coord": [0]}

Only ``Shard(dim)`` and ``Replicate()`` are captured; any other placement (``Partial``,
``_StridedShard``) is refused at capture (``PlacementUnsupported``). A restore onto a mesh
of another shape, dim names or rank list is refused (``ReshardUnsupported``), and so is one
at another coordinate, unless the two coordinates differ only along the mesh dimensions the
DTensor is replicated over (HSDP's replicate dimension): those ranks hold the same shard
(``replica_group``), so one heals another from its live copy.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from phalanx.configs.errors import PlacementUnsupported, ReshardUnsupported
from phalanx.runtime.snapshot.spec_names import DTENSOR_TAG

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

_MODULE = "torch.distributed.tensor"    # imported lazily: ~0.6 s, only by jobs that use it
_FIX = ("restore onto the same world size and mesh shape, or save a DCP checkpoint "
        "(torch.distributed.checkpoint) and load it into the new mesh to reshard")


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (never true before a script imported DTensors)."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def _placement(p: Placement, path: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    if type(p) is Shard:
        return {"shard": int(p.dim)}
    if type(p) is Replicate:
        return {"replicate": True}
    raise PlacementUnsupported(
        f"cannot snapshot the DTensor at '{path}': placement {p!r} is not supported (only "
        "Shard(dim) and Replicate() are); shard the model with fully_shard on a 1-D or "
        "2-D (replicate, shard) DeviceMesh, or redistribute the tensor to Shard/Replicate "
        "before registering it")


def mesh_info(mesh: DeviceMesh) -> dict[str, Any]:
    """The JSON description of ``mesh`` a spec node carries (and a live mesh is matched by)."""
    return {"device": mesh.device_type, "shape": list(mesh.shape),
            "dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "ranks": [int(r) for r in mesh.mesh.reshape(-1).tolist()]}


def describe(value: DTensor, path: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """``value``'s local shard and its spec node, less ``name``. Raises
    PlacementUnsupported naming ``path`` for a placement other than Shard or Replicate."""
    mesh = value.device_mesh
    placements = [_placement(p, path) for p in value.placements]
    coord = mesh.get_coordinate()
    return value.to_local(), {
        "t": DTENSOR_TAG, "mesh": mesh_info(mesh), "placements": placements,
        "shape": list(value.shape), "stride": list(value.stride()),
        "coord": None if coord is None else [int(c) for c in coord]}


def replica_group(value: DTensor) -> tuple[int, ...]:
    """The ranks that hold the same local shard of ``value`` as this rank: the mesh's ranks
    whose coordinate equals this rank's along every dimension it is not replicated over
    (HSDP's (Replicate(), Shard(0)) on a 2 x 2 mesh [[0, 1], [2, 3]]: (1, 3) on rank 1;
    FSDP's Shard(0) alone: this rank only). Sorted."""
    from torch.distributed.tensor import Replicate
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return ()
    kept = [d for d, p in enumerate(value.placements) if type(p) is not Replicate]
    ranks = mesh.mesh
    index = tuple(int(coord[d]) if d in kept else slice(None) for d in range(mesh.ndim))
    return tuple(sorted(int(r) for r in ranks[index].reshape(-1).tolist()))


def _same_shard(saved: Any, coord: Sequence[int] | None, placements: Any) -> bool:
    """Whether the shard saved at coordinate ``saved`` is the one this rank (at ``coord``)
    holds: equal along every dimension whose placement is not ``{"replicate": true}``."""
    if coord is None or saved is None:
        return saved is None and coord is None
    if type(saved) is not list or len(saved) != len(coord) \
            or type(placements) is not list or len(placements) != len(coord):
        return False
    return all(s == c or p == {"replicate": True}
               for s, c, p in zip(saved, coord, placements))


def _describe_mesh(info: Mapping[str, Any]) -> str:
    dims = info.get("dims")
    names = f" dims {tuple(dims)}" if dims else ""
    return f"{info.get('device')} mesh {tuple(info.get('shape', ()))}{names} over ranks " \
           f"{info.get('ranks')}"


def live_meshes(objects: Iterable[Any]) -> list[DeviceMesh]:
    """The DeviceMeshes the live DTensors of ``objects`` are on: a module's parameters and
    buffers, an optimizer's parameters (its state may not exist yet on a fresh rank), a
    DTensor registered as a value; a view of a module or optimizer (``state_classes``'
    ``ParamsOf``, ``OptimizerStateOf``: its ``viewed``) as that object. Distinct meshes,
    in first-seen order."""
    found: list[DeviceMesh] = []
    if _MODULE not in sys.modules:
        return found
    for obj in objects:
        obj = getattr(obj, "viewed", obj)
        tensors: Iterable[Any] = ()
        if isinstance(obj, torch.nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = [p for group in obj.param_groups for p in group["params"]]
        elif is_dtensor(obj):
            tensors = (obj,)
        for t in tensors:
            if is_dtensor(t) and all(t.device_mesh is not m for m in found):
                found.append(t.device_mesh)
    return found


def _decode_placement(node: Any) -> Placement:
    from torch.distributed.tensor import Replicate, Shard
    if type(node) is dict and type(node.get("shard")) is int and len(node) == 1:
        return Shard(node["shard"])
    if node == {"replicate": True}:
        return Replicate()
    raise ValueError(f"unknown DTensor placement {node!r:.80}")


def _ints(value: Any) -> list[int]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise ValueError(f"expected a list of ints, got {value!r:.80}")
    return value


def _mesh_for(node: Mapping[str, Any], meshes: Sequence[DeviceMesh], path: str) -> DeviceMesh:
    """The live mesh equal to the snapshot's (device, shape, dims, ranks), with this rank
    at the snapshot's coordinate or one holding the same shard (``_same_shard``);
    ReshardUnsupported naming both otherwise."""
    want = node["mesh"]
    for mesh in meshes:
        if mesh_info(mesh) != want:
            continue
        coord = mesh.get_coordinate()
        if not _same_shard(node["coord"], None if coord is None else [int(c) for c in coord],
                           node.get("placements")):
            raise ReshardUnsupported(
                f"the snapshot's DTensor at '{path}' is the shard at coordinate "
                f"{node['coord']} of the {_describe_mesh(want)}, but this rank is at "
                f"{coord} of it: a rank restores only its own shards or those of the ranks "
                f"it is replicated with; {_FIX}")
        return mesh
    live = "; ".join(_describe_mesh(mesh_info(m)) for m in meshes) or "no DTensor is live"
    raise ReshardUnsupported(
        f"the snapshot's DTensor at '{path}' was sharded over the {_describe_mesh(want)}, "
        f"but the registered state lives on: {live}; resharding a snapshot is not "
        f"supported: {_FIX}")


def rebuild(local: torch.Tensor, node: Mapping[str, Any], meshes: Sequence[DeviceMesh],
            path: str) -> DTensor:
    """The DTensor of ``node`` over its live mesh, with ``local`` (the restored shard, a live
    shard copied into when one fit) as its local tensor. Raises ReshardUnsupported when no
    live mesh matches; ValueError when the node is malformed or ``local`` is not the shard
    its placements give this coordinate (the caller reports SnapshotCorrupt)."""
    mesh = _mesh_for(node, meshes, path)
    placements = tuple(_decode_placement(p) for p in node["placements"])
    shape, stride = torch.Size(_ints(node["shape"])), tuple(_ints(node["stride"]))
    if len(placements) != mesh.ndim:
        raise ValueError(f"{len(placements)} placements for a {mesh.ndim}-D mesh")
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    expected, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(local.shape) != tuple(expected):
        raise ValueError(f"local shard of shape {tuple(local.shape)} where the placements "
                         f"give {tuple(expected)} for global shape {tuple(shape)}")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=stride)
