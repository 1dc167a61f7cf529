"""DDP's ``_DDPSink`` reaches its module in backward through a weak reference, seen dead
with the module alive (a fresh clone's DDP drill raised ``'NoneType' object has no
attribute 'reducer'`` there and lost the rank). With phalanx's DDP patches the sink's
backward still reaches the module: the gradients equal the ones of the model without DDP."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.group.default_group import _patch_ddp_sink

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class _Gone:
    pass


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _kill_sink_weakref(out: torch.Tensor) -> None:
    """Point the sink node of ``out`` at a dead weak reference, as seen in the drill."""
    node = out.grad_fn
    assert type(node).__name__ == "_DDPSinkBackward", type(node)
    dead = _Gone()
    ref = weakref.ref(dead)
    del dead
    assert ref() is None
    node.ddp_weakref = ref


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.usefixtures("one_rank")
def test_a_static_graphs_first_backward_survives_a_dead_sink_weakref(monkeypatch) -> None:
    from torch.nn.parallel.distributed import _DDPSink

    for name in ("forward", "backward"):       # torch's own sink, whatever ran before
        own = getattr(_DDPSink, name)
        monkeypatch.setattr(_DDPSink, name, staticmethod(getattr(own, "__wrapped__", own)))
    monkeypatch.setattr(_DDPSink, "_phalanx_strong", False, raising=False)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict(plain.state_dict())
    x = torch.randn(5, 4)
    plain(x).square().sum().backward()

    ddp = DistributedDataParallel(model, static_graph=True)
    out = ddp(x)
    _kill_sink_weakref(out)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'reducer'"):
        out.square().sum().backward()          # torch's own sink: what the drill hit

    _patch_ddp_sink()
    _patch_ddp_sink()                           # idempotent
    model.zero_grad()
    ddp = DistributedDataParallel(model, static_graph=True)
    out = ddp(x)
    _kill_sink_weakref(out)
    out.square().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(plain)))
