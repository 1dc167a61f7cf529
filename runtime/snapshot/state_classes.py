"""Where each piece of registered state has its redundancy (DESIGN.md, "State classes").

- **replicated**: every rank of a *replica group* holds the same value live: the
  parameters of a ``DistributedDataParallel`` module (the group: its process group's
  ranks, every rank on the default group) or of a module declared replicated (every
  rank), the local shards of an HSDP module (``DTensor`` s placed ``Replicate()`` along
  some mesh dimension: the group is the ranks along it, ``dtensor.replica_group``), and
  the state of an optimizer whose parameters are all such parameters. A lost rank is
  healed from a survivor of its group; snapshots of it are needed only when every replica
  is lost, so they are taken at the full-snapshot interval only. A rank's replicated
  objects share one group (``StateClasses.group``); a module replicated over another group
  than the first one found is sharded (DTensors) or per-rank (otherwise).
- **sharded**: other ``DTensor`` state (FSDP2 parameters and their optimizer state) and a
  ``ZeroRedundancyOptimizer``'s partition (``runtime.snapshot.zero``): no live copy exists
  elsewhere, so it is snapshotted with the per-rank state.
- **per_rank**: everything else: RNGs, data position, extras, schedulers, module buffers
  (BatchNorm statistics differ per rank without SyncBatchNorm), plain modules, and a
  replicated optimizer's hyperparameters (``GroupsOf``: a scheduler sets them between
  steps, so they go back with the scheduler on every rank at a recovery).

``classify`` infers the classes and builds two *views* of the registered objects: the
replicated one (what a survivor sends a replacement) and the per-rank one (what every rank
snapshots every step). A module split between the two is represented by ``ParamsOf`` /
``BuffersOf``, an optimizer by ``OptimizerStateOf`` / ``GroupsOf``, which have
``state_dict``/``load_state_dict`` like the object itself, so both views are captured and
applied with the ordinary snapshot code.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.snapshot.dtensor import replica_group
from phalanx.runtime.snapshot.zero import is_zero

log = logging.getLogger(__name__)
StateClass = Literal["replicated", "sharded", "per_rank"]
CLASSES: tuple[str, ...] = ("replicated", "sharded", "per_rank")


class _ModulePart:
    """The parameters (``ParamsOf``) or the other entries (``BuffersOf``) of a module's
    state dict; ``load_state_dict`` copies into the live module (``strict=False`` on the
    other part, every key of this part required)."""

    params = True

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._cached: list[str] | None = None

    @property
    def viewed(self) -> torch.nn.Module:
        """The module this is a part of (``dtensor.live_meshes`` finds its meshes there)."""
        return self.module

    def _keys(self) -> list[str]:
        """This part's state-dict keys (read once: a module's structure is fixed by the
        time training snapshots it)."""
        if self._cached is None:
            self._cached = [key for key, value in self.module.state_dict(keep_vars=True).items()
                            if isinstance(value, torch.nn.Parameter) == self.params]
        return self._cached

    def state_dict(self) -> dict[str, Any]:
        keys = set(self._keys())
        return {k: v for k, v in self.module.state_dict().items() if k in keys}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        wanted, given = set(self._keys()), set(state)
        if wanted != given:
            raise ValueError(f"{type(self).__name__}: state holds {sorted(given - wanted)[:5]} "
                             f"extra and lacks {sorted(wanted - given)[:5]}")
        result = self.module.load_state_dict(dict(state), strict=False)
        if result.unexpected_keys:
            raise ValueError(f"unexpected keys {result.unexpected_keys[:5]}")

    def __bool__(self) -> bool:
        return bool(self._keys())


class ParamsOf(_ModulePart):
    """A module's parameters: its replicated part under data parallelism."""

    params = True


class BuffersOf(_ModulePart):
    """A module's buffers and extra state: per-rank (BatchNorm statistics)."""

    params = False


class OptimizerStateOf:
    """An optimizer's tensor state (momentum buffers, Adam's moments and step counts) and
    its groups' parameter indices: its replicated part under data parallelism. Loading
    keeps the live hyperparameters (``GroupsOf`` restores those)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def viewed(self) -> torch.optim.Optimizer:
        return self.optimizer

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        return {"state": state["state"],
                "param_groups": [{"params": g["params"]} for g in state["param_groups"]]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        live = self.optimizer.state_dict()["param_groups"]
        given = list(state["param_groups"])
        if len(given) != len(live):
            raise ValueError(f"OptimizerStateOf: state holds {len(given)} parameter groups, "
                             f"the optimizer {len(live)}")
        self.optimizer.load_state_dict({
            "state": state["state"],
            "param_groups": [{**g, "params": s["params"]} for g, s in zip(live, given)]})


class GroupsOf:
    """An optimizer's hyperparameters, group by group (``lr``, ``momentum``, ``betas``, a
    scheduler's ``initial_lr``; not the parameters): per-rank, restored with the scheduler
    that sets them. A scheduler steps between steps (at an epoch's end): a rank that re-runs
    that code after a recovery must find the learning rate the restored scheduler belongs
    to, also where it keeps its live replicated state (a survivor healing in place), or it
    steps the rate twice."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def viewed(self) -> torch.optim.Optimizer:
        return self.optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"param_groups": [{k: v for k, v in group.items() if k != "params"}
                                 for group in self.optimizer.param_groups]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        given, live = list(state["param_groups"]), self.optimizer.param_groups
        if len(given) != len(live):
            raise ValueError(f"GroupsOf: state holds {len(given)} parameter groups, the "
                             f"optimizer {len(live)}")
        for group, saved in zip(live, given):
            for key, value in saved.items():
                old = group.get(key)
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and old.shape == value.shape and old.dtype == value.dtype:
                    with torch.no_grad():
                        old.copy_(value)       # a tensor learning rate keeps its identity
                else:
                    group[key] = value


@dataclass
class StateClasses:
    """The registered objects sorted by class, and the two views snapshots and heals use."""

    kinds: dict[str, str] = field(default_factory=dict)   # object name -> class or "split"
    replicated: dict[str, Any] = field(default_factory=dict)
    per_rank: dict[str, Any] = field(default_factory=dict)
    group: tuple[int, ...] = ()     # the ranks the replicated view is alike on; (): every rank

    @property
    def split(self) -> bool:
        """Whether some state is replicated (else the per-rank view is every object)."""
        return bool(self.replicated)

    def describe(self) -> str:
        kinds = " ".join(f"{name}={kind}" for name, kind in sorted(self.kinds.items()))
        return f"{kinds} replica_group={list(self.group)}" if self.group else kinds


def _is_sharded(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


def _mesh_replicas(params: list[Any]) -> tuple[int, ...] | None:
    """The ranks that hold the same local shards of every one of ``params`` as this rank
    (HSDP's replicate dimension), when all are DTensors replicated over one group of more
    than this rank; None otherwise (FSDP's shards: each rank its own)."""
    if not params or not all(_is_sharded(p) for p in params):
        return None
    groups = {replica_group(p) for p in params}
    if len(groups) != 1:
        return None
    (group,) = groups
    return group if len(group) > 1 else None


def _ddp_wrapped(modules: Mapping[str, torch.nn.Module]) -> dict[int, Any]:
    """The live DDP that wraps each registered plain module some DDP wraps, by the
    module's id (one scan of the garbage collector's objects, at start only)."""
    wanted = {id(m) for m in modules.values()}
    if not wanted:
        return {}
    # type(), not isinstance(): the latter reads __class__ of every object (deprecated
    # module proxies warn)
    return {id(obj.module): obj for obj in gc.get_objects()
            if issubclass(type(obj), DistributedDataParallel) and id(obj.module) in wanted}


def _compiled(module: torch.nn.Module) -> Any:
    """The module ``torch.compile`` wrapped (its ``OptimizedModule``'s ``_orig_mod``), or
    None for a module that is not a compiled one (type name only: no dynamo import)."""
    return getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" \
        else None


def _ddp_replicas(ddp: Any) -> tuple[int, ...]:
    """The ranks a DDP module's parameters are alike on: those of its process group when
    that is not the whole world (a data-parallel group made by ``new_group``, beside
    pipeline or tensor parallel ones); () for every rank."""
    group = getattr(ddp, "process_group", None)
    if group is None or not dist.is_initialized() or group is dist.group.WORLD:
        return ()
    try:
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    except (RuntimeError, ValueError, KeyError):    # not a registered group
        return ()
    return () if len(ranks) == dist.get_world_size() else ranks


def _optimizer_params(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in opt.param_groups:
        yield from group["params"]


def classify(objects: Mapping[str, Any], declared: Mapping[str, str] | None = None,
             *, data_parallel: bool = True) -> StateClasses:
    """Sort ``objects`` (name -> registered object) into the state classes.

    Inferred: a DDP module (registered as the DDP wrapper, as the module it wraps, or as
    ``torch.compile``'s wrapper of the DDP module) has
    parameters replicated over its process group's ranks and per-rank buffers; a module
    with ``DTensor`` parameters is replicated over their mesh's replicate dimension when it
    has one (HSDP), else sharded; an optimizer is replicated when every parameter it
    updates is a replicated module's, else sharded when any is a ``DTensor``; everything
    else is per-rank.
    ``declared`` (name -> class) overrides the inference for an object (a module declared
    replicated still keeps its buffers per-rank). ``data_parallel=False`` (one rank):
    nothing is replicated."""
    declared = dict(declared or {})
    for name, kind in declared.items():
        if kind not in CLASSES:
            raise ValueError(f"state {name!r} declared {kind!r}: use one of {list(CLASSES)}")
        if name not in objects:
            raise ValueError(f"state {name!r} is declared {kind!r} but not registered; "
                             f"registered: {sorted(objects)}")
    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)
               and not isinstance(o, DistributedDataParallel)}
    wrapped = _ddp_wrapped({n: m for n, m in modules.items() if n not in declared}) \
        if data_parallel else {}
    out = StateClasses()
    replicated_params: set[int] = set()
    chosen: tuple[int, ...] | None = None   # the replica group, once one is found

    def fits(group: tuple[int, ...], name: str) -> bool:
        nonlocal chosen
        if chosen is None or chosen == group:
            chosen = group
            return True
        log.info("event=state_class_other_group name=%s group=%s replica_group=%s", name,
                 list(group) or "all", list(chosen) or "all")
        return False

    for name, obj in objects.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        params = list(obj.parameters())
        sharded = any(_is_sharded(p) for p in params)
        group = _mesh_replicas(params) if data_parallel and sharded else None
        ddp = obj if isinstance(obj, DistributedDataParallel) else wrapped.get(id(obj))
        if ddp is None and isinstance(_compiled(obj), DistributedDataParallel):
            ddp = _compiled(obj)        # torch.compile(DDP(model)): the same parameters
        if sharded:
            kind = "sharded" if group is None else "replicated"
        elif ddp is not None:
            group = _ddp_replicas(ddp)
            kind = "replicated" if len(group) != 1 else "per_rank"
        else:
            kind = "per_rank"
        kind = declared.get(name, kind)
        if kind == "replicated" and data_parallel and not fits(group or (), name):
            kind = "sharded" if sharded else "per_rank"
        if kind == "replicated" and data_parallel:
            replicated_params.update(id(p) for p in params)
            out.replicated[name] = ParamsOf(obj)
            buffers = BuffersOf(obj)
            if buffers:
                out.per_rank[name] = buffers
            out.kinds[name] = "split" if buffers else "replicated"
        else:
            out.per_rank[name] = obj
            out.kinds[name] = "per_rank" if kind == "replicated" else kind
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            continue
        kind = "per_rank"
        if is_zero(obj):     # each rank holds its own partition's state (runtime.snapshot.zero)
            kind = "sharded"
            if declared.get(name, kind) == "replicated":
                raise ValueError(f"state {name!r} is a ZeroRedundancyOptimizer, declared "
                                 "replicated: each rank holds only its own partition's "
                                 "state; leave it undeclared (sharded)")
        elif isinstance(obj, torch.optim.Optimizer):
            updated = list(_optimizer_params(obj))
            if updated and all(id(p) in replicated_params for p in updated):
                kind = "replicated"     # over the replicated modules' group
            elif any(_is_sharded(p) for p in updated):
                kind = "sharded"
        kind = declared.get(name, kind)
        if kind == "replicated" and data_parallel \
                and isinstance(obj, torch.optim.Optimizer):
            out.replicated[name] = OptimizerStateOf(obj)
            out.per_rank[name] = GroupsOf(obj)
            kind = "split"
        elif kind == "replicated" and data_parallel:
            out.replicated[name] = obj
        else:
            out.per_rank[name] = obj
            kind = "per_rank" if kind == "replicated" else kind
        out.kinds[name] = kind
    out.group = chosen or ()
    log.info("event=state_classes %s", out.describe())
    return out
