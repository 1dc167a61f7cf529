"""``torch.distributed.optim.ZeroRedundancyOptimizer``: sharded optimizer state.

ZeRO partitions the optimizer state over the ranks of its process group: each rank's local
optimizer (``zero.optim``) updates its own partition of the parameters and broadcasts the
result, so no other rank holds that state. Its ``state_dict()`` is the consolidated global
state, which raises unless every rank first called ``consolidate_state_dict`` (a
collective): not something a snapshot can do every step. A snapshot captures
``ZeroShard(zero)`` instead, the state only this rank holds:

- ``local``: the local optimizer's state dict (its partition's state, indexed locally);
- ``groups``: the hyperparameters of ZeRO's global param groups (an LR scheduler sets
  them there, and ZeRO copies them into the local optimizer at every step, so restoring
  the local optimizer alone would be overwritten by the replacement's initial values);
- ``rank`` / ``world``: where the partition belongs. A partition restores only onto the
  same rank of the same world size (``ZeroReshardUnsupported`` otherwise).

The state class is ``sharded`` (``state_classes.classify``): snapshotted with the per-rank
state, never sent from a survivor, never compared across ranks.
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

from phalanx.configs.errors import PhalanxError

_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


class ZeroReshardUnsupported(PhalanxError):
    """A ZeroRedundancyOptimizer partition captured on one rank or world size is restored
    on another: its state belongs to other parameters there."""


def is_zero(obj: Any) -> bool:
    """Whether ``obj`` is a ZeroRedundancyOptimizer (without importing ZeRO's module when
    the script never did)."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(obj, module.ZeroRedundancyOptimizer)


def stateful(obj: Any) -> Any:
    """What a snapshot calls ``state_dict``/``load_state_dict`` on for a registered object:
    its ``ZeroShard`` for a ZeroRedundancyOptimizer, the object itself otherwise."""
    return ZeroShard(obj) if is_zero(obj) else obj


class ZeroShard:
    """The part of a ZeroRedundancyOptimizer's state this rank alone holds (module
    docstring)."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero

    def _place(self) -> tuple[int, int]:
        return int(self.zero.rank), int(self.zero.world_size)

    def state_dict(self) -> dict[str, Any]:
        rank, world = self._place()
        return {"local": self.zero.optim.state_dict(), "rank": rank, "world": world,
                "groups": [{k: v for k, v in group.items() if k != "params"}
                           for group in self.zero.param_groups]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rank, world = self._place()
        if (state["rank"], state["world"]) != (rank, world):
            raise ZeroReshardUnsupported(
                f"ZeroRedundancyOptimizer state of rank {state['rank']} of world "
                f"{state['world']} cannot be restored on rank {rank} of world {world}: its "
                "partition holds other parameters there; restore at the world size it was "
                "captured at")
        groups = state["groups"]
        if len(groups) != len(self.zero.param_groups):
            raise ValueError(f"ZeroRedundancyOptimizer state has {len(groups)} param groups, "
                             f"the optimizer {len(self.zero.param_groups)}")
        self.zero.optim.load_state_dict(state["local"])
        for group, saved in zip(self.zero.param_groups, groups):
            group.update(saved)
