"""Refusing gradients accumulated across ``session.step()`` calls: a snapshot holds no
gradients, so a restore to such a step boundary would silently drop what was accumulated.

At each capture the guard arms a one-shot hook on every parameter of a registered
optimizer (of the registered modules, without one) that holds a gradient. The next
backward runs the hook before it adds into ``.grad``: when ``.grad`` is still the very
tensor of the boundary, unwritten since (not zeroed, not set to None: its version counter
unchanged), this backward accumulates into gradients of a previous step, and the guard
raises ``StateNotCapturable`` out of ``backward()``. Zeroing at the start of a step
(``zero_grad()``, either flavour) passes; so does accumulating inside one step. Any other
in-place write to ``.grad`` between the boundary and that backward passes as a zeroing.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Iterator, Mapping

import torch

from phalanx.configs.errors import StateNotCapturable
from phalanx.runtime.snapshot.copy_check import tensor_version

log = logging.getLogger(__name__)


class AccumulationGuard:
    """Owned by the Session; ``arm``/``disarm`` on the training thread, the hooks on the
    thread running backward. Holds only weak references to gradients (a zeroed-to-None
    gradient is freed as before)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._handles: list[Any] = []
        self._step = -1

    def arm(self, step: int, objects: Mapping[str, Any]) -> None:
        """At the capture of ``step``: watch the next backward of every registered
        parameter that holds a gradient now."""
        self.disarm()
        self._step = step
        for name, param in _parameters(objects):
            grad = param.grad
            if grad is None or not param.requires_grad:
                continue
            version = tensor_version(grad)
            if version is None:
                continue
            hook = self._hook(name, param, weakref.ref(grad), version)
            self._handles.append(param.register_hook(hook))

    def disarm(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _hook(self, name: str, param: torch.Tensor, boundary: "weakref.ref[torch.Tensor]",
              version: int) -> Any:
        fired = [False]
        param_ref = weakref.ref(param)

        def check(_grad: torch.Tensor) -> None:
            if fired[0]:
                return
            fired[0] = True
            live = param_ref()
            held = None if live is None else live.grad
            if held is not None and held is boundary() and tensor_version(held) == version:
                log.error("event=gradient_accumulation_refused rank=%d step=%d param=%s",
                          self._rank, self._step, name)
                raise StateNotCapturable(
                    f"rank {self._rank}: parameter '{name}' accumulates gradients across "
                    f"session.step() calls (its .grad from before step {self._step} was not "
                    "zeroed): snapshots hold no gradients, so a restore would lose them. "
                    "Accumulate inside one session.step() (run the micro-batches' backward "
                    "passes, then optimizer.step() and zero_grad(), within the same step); "
                    "see docs/porting.md, 'What the loop must not do'")
        return check


def _parameters(objects: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, parameter) of every registered optimizer, each parameter once and named by
    its registered module where one holds it: the gradients an optimizer step consumes (a
    parameter no optimizer holds may keep a gradient it never uses). Without a registered
    optimizer, the registered modules' parameters."""
    names: dict[int, tuple[str, torch.Tensor]] = {}
    for obj_name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for key, param in obj.named_parameters():
                names.setdefault(id(param), (f"{obj_name}.{key}", param))
    optimizers = [(n, o) for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)]
    if not optimizers:
        yield from names.values()
        return
    seen: set[int] = set()
    for obj_name, optimizer in optimizers:
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield names.get(id(param), (f"{obj_name}.param_groups[{g}][{i}]", param))
