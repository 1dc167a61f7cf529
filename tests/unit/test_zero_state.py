"""``runtime.snapshot.zero``: a ZeroRedundancyOptimizer is captured as the state only this
rank holds (its local optimizer's partition and its param groups' hyperparameters),
restored onto the same rank and world size only, classified sharded and left out of the
replica comparison."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from phalanx.runtime.consistency.verify import compared_names
from phalanx.runtime.snapshot.state_classes import classify
from phalanx.runtime.snapshot.state_tree import apply_state, flatten_state
from phalanx.runtime.snapshot.zero import ZeroReshardUnsupported, ZeroShard, is_zero

pytestmark = pytest.mark.unit


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trained(seed: int) -> tuple[torch.nn.Module, ZeroRedundancyOptimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                   lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        zero.step()
        scheduler.step()
        zero.zero_grad()
    return model, zero, scheduler


def test_a_snapshot_round_trips_the_partition_and_the_scheduled_lr(group) -> None:
    model, zero, _ = _trained(0)
    with pytest.raises(RuntimeError, match="consolidate"):   # what a snapshot called before
        zero.state_dict()
    tensors, spec = flatten_state({"optimizer": zero})
    assert any(name.startswith("optimizer/local") for name in tensors)
    saved = {k: v.clone() for k, v in tensors.items()}
    # a replacement: the same script from the top, its scheduler not yet stepped
    fresh_model, fresh, _ = _trained(1)
    fresh.param_groups[0]["lr"] = 0.1
    apply_state({"optimizer": fresh}, saved, spec)
    assert fresh.param_groups[0]["lr"] == zero.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    mine, theirs = ZeroShard(zero).state_dict()["local"], ZeroShard(fresh).state_dict()["local"]
    for index, state in mine["state"].items():
        for key, value in state.items():
            assert torch.equal(theirs["state"][index][key], value), (index, key)
    # ZeRO copies the global groups into the local optimizer at its next step: the
    # restored lr is the one used
    fresh_model.load_state_dict(model.state_dict())
    for m, opt in ((model, zero), (fresh_model, fresh)):
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_a_partition_is_refused_on_another_rank_or_world(group) -> None:
    _, zero, _ = _trained(0)
    state = ZeroShard(zero).state_dict()
    with pytest.raises(ZeroReshardUnsupported, match="rank 0 of world 4 cannot be restored "
                                                     "on rank 0 of world 1"):
        ZeroShard(zero).load_state_dict({**state, "world": 4})


def test_it_is_sharded_and_never_compared(group) -> None:
    model, zero, scheduler = _trained(0)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert is_zero(zero) and not is_zero(plain) and not is_zero(None)
    classes = classify({"model": model, "optimizer": zero, "scheduler": scheduler})
    assert classes.kinds["optimizer"] == "sharded" and "optimizer" in classes.per_rank
    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer, declared replicated"):
        classify({"model": model, "optimizer": zero}, {"optimizer": "replicated"})
    assert compared_names({"model": model, "optimizer": zero}, ["model", "optimizer"]) \
        == ("model",)
    assert compared_names({"model": model, "optimizer": plain}, ["model", "optimizer"]) \
        == ("model", "optimizer")
