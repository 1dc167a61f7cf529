"""State classes (``phalanx.runtime.snapshot.state_classes``): inferred from DDP, declared
otherwise; the two views capture and apply with the ordinary snapshot code; and the heal's
step rule (``phalanx.runtime.worker.heal``), pure."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.snapshot.state_classes import (BuffersOf, GroupsOf, OptimizerStateOf,
                                                    ParamsOf, classify)
from phalanx.runtime.snapshot.state_tree import RNGState, apply_state, flatten_state
from phalanx.runtime.worker.heal import candidates, choose_step
from tests.unit.test_dtensor_state import fake_world


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("registered", ["wrapper", "inner", "compiled"])
def test_a_ddp_model_and_its_optimizer_are_replicated_and_buffers_per_rank(
        one_rank_group: None, registered: str) -> None:
    """Registered as the DDP module, the module it wraps, or ``torch.compile(ddp)`` (the
    order PyTorch's DDP + compile notes give; before, that one was taken for a plain
    module: everything per-rank, nothing healed from a survivor)."""
    inner = _model()
    ddp = DistributedDataParallel(inner)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    model = {"wrapper": ddp, "inner": inner,
             "compiled": torch.compile(ddp, backend="eager")}[registered]
    objects = {"model": model, "optimizer": opt, "scheduler": sched, "__rng__": RNGState()}
    classes = classify(objects)
    assert classes.kinds == {"model": "split", "optimizer": "split",
                             "scheduler": "per_rank", "__rng__": "per_rank"}
    assert isinstance(classes.replicated["model"], ParamsOf)
    assert isinstance(classes.per_rank["model"], BuffersOf)
    assert isinstance(classes.replicated["optimizer"], OptimizerStateOf)
    assert isinstance(classes.per_rank["optimizer"], GroupsOf)
    assert set(classes.per_rank) == {"model", "optimizer", "scheduler", "__rng__"}


def test_without_ddp_or_declaration_nothing_is_replicated() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    classes = classify({"model": model, "optimizer": opt})
    assert not classes.split and set(classes.per_rank) == {"model", "optimizer"}
    declared = classify({"model": model, "optimizer": opt}, {"model": "replicated"})
    assert declared.kinds == {"model": "split", "optimizer": "split"}
    one_rank = classify({"model": model}, {"model": "replicated"}, data_parallel=False)
    assert not one_rank.split


def test_a_declaration_naming_an_unknown_object_or_class_is_refused() -> None:
    with pytest.raises(ValueError, match="not registered"):
        classify({"model": _model()}, {"modle": "replicated"})
    with pytest.raises(ValueError, match="use one of"):
        classify({"model": _model()}, {"model": "shared"})


def test_the_views_round_trip_through_the_snapshot_code_without_touching_the_other_part() -> None:
    source, target = _model(), _model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
        source[1].running_mean.add_(3.0)
    params_before = [p.clone() for p in target.parameters()]
    tensors, spec = flatten_state({"model": BuffersOf(source)})
    assert all("running" in n or "num_batches" in n for n in tensors)
    apply_state({"model": BuffersOf(target)}, {n: t.clone() for n, t in tensors.items()}, spec)
    assert torch.equal(target[1].running_mean, source[1].running_mean)
    assert all(torch.equal(a, b) for a, b in zip(params_before, target.parameters()))
    tensors, spec = flatten_state({"model": ParamsOf(source)})
    apply_state({"model": ParamsOf(target)}, {n: t.clone() for n, t in tensors.items()}, spec)
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))


def test_an_optimizer_s_moments_heal_while_its_scheduled_rate_goes_back_with_the_scheduler(
) -> None:
    """The replicated view of an optimizer carries its tensor state, never its
    hyperparameters; the per-rank view carries those (a scheduler stepped at an epoch's
    end changed them after the snapshot). A survivor healing in place restores the
    per-rank view only: its learning rate goes back with its scheduler, its moments stay.
    Before, the rate stayed stepped and the re-run epoch's end stepped it again."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    groups, groups_spec = flatten_state({"optimizer": GroupsOf(opt)})
    scheduled, spec = flatten_state({"scheduler": sched})
    moments, moments_spec = flatten_state({"optimizer": OptimizerStateOf(opt)})
    assert '"lr"' not in json.dumps(moments_spec) and '"lr"' in json.dumps(groups_spec)
    sched.step()                                 # the epoch's end, after the snapshot
    assert opt.param_groups[0]["lr"] == 0.05
    exp_avg = opt.state[next(iter(model.parameters()))]["exp_avg"].clone()
    apply_state({"optimizer": GroupsOf(opt)}, groups, groups_spec)
    apply_state({"scheduler": sched}, scheduled, spec)
    assert opt.param_groups[0]["lr"] == 0.1 and tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9)
    assert torch.equal(opt.state[next(iter(model.parameters()))]["exp_avg"], exp_avg)
    sched.step()                                 # the re-run epoch's end: once, as before
    assert opt.param_groups[0]["lr"] == 0.05
    other = torch.optim.Adam(_model().parameters(), lr=0.3)      # a replacement's
    apply_state({"optimizer": OptimizerStateOf(other)}, moments, moments_spec)
    assert other.param_groups[0]["lr"] == 0.3                    # its own rate kept
    assert torch.equal(other.state[other.param_groups[0]["params"][0]]["exp_avg"],
                       exp_avg)


def test_the_step_rule() -> None:
    # replicated state: only survivors' live steps are candidates, newest first
    assert candidates([6, 5, -1], replicated=True) == [6, 5]
    assert candidates([-1, -1], replicated=True) == []
    # without replicated state every rank restores: the newest few steps
    assert candidates([6, 5, -1], replicated=False) == [6, 5, 4]
    # forward when every rank has the newer step, back when one lacks it
    assert choose_step([6, 5, -1], [[1, 1], [1, 1], [1, 1]], [6, 5], True) == 6
    assert choose_step([6, 5, -1], [[1, 1], [1, 1], [0, 1]], [6, 5], True) == 5
    # no survivor holds step 5 live: no heal
    assert choose_step([6, 6, -1], [[1, 1], [1, 1], [0, 1]], [6, 5], True) is None
    # without replicated state a step nobody holds live is fine
    assert choose_step([6, 6, -1], [[1, 1], [1, 1], [0, 1]], [6, 5], False) == 5
    # replica groups (HSDP pairs {0, 2} and {1, 3}): every group needs a live holder
    pairs = [0, 1, 0, 1]
    assert choose_step([6, -1, 6, 6], [[1]] * 4, [6], True, pairs) == 6
    assert choose_step([6, -1, 6, -1], [[1]] * 4, [6], True, pairs) is None
    # rank 3 applied step 6, rank 1 was lost: only step 6 has a holder in each pair
    assert choose_step([5, -1, 5, 6], [[1, 1]] * 4, [6, 5], True, pairs) is None
    assert choose_step([6, -1, 5, 6], [[1, 1]] * 4, [6, 5], True, pairs) == 6


def test_a_ddp_module_on_a_group_of_some_ranks_is_replicated_over_those_ranks() -> None:
    """DDP over a data-parallel group made by ``new_group`` (ranks 1 and 3 of 4, beside
    another parallel dimension): its parameters heal only from rank 3; a DDP on the
    default group is replicated over every rank."""
    with fake_world(1, 4):
        pair = dist.new_group([1, 3])
        model = torch.nn.Linear(4, 2)
        ddp = DistributedDataParallel(model, process_group=pair)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        classes = classify({"model": ddp, "optimizer": opt})
        assert classes.kinds == {"model": "replicated", "optimizer": "split"}
        assert classes.group == (1, 3)
        inner = classify({"model": model, "optimizer": opt})      # the wrapped module
        assert inner.group == (1, 3) and inner.kinds["model"] == "replicated"
        everyone = torch.nn.Linear(4, 2)
        on_world = DistributedDataParallel(everyone)
        classes = classify({"model": on_world})
        assert classes.kinds == {"model": "replicated"} and classes.group == ()
        # two groups in one job: the first found is the replica group, the other per-rank
        mixed = classify({"model": ddp, "other": on_world})
        assert mixed.kinds == {"model": "replicated", "other": "per_rank"}
        assert mixed.group == (1, 3)
