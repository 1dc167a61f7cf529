"""The session's collective on a real TCPStore and real gloo groups: formation that a newer
generation (or a peer that never comes) interrupts at once, and groups that form normally."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.group.collective import Collective, CollectiveAborted


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_forming_is_abandoned_when_a_newer_generation_begins(store: Callable[[], dist.Store]) -> None:
    collective = Collective(store, rank=0, world_size=2, timeout_s=30.0)
    newer = threading.Event()
    threading.Timer(0.3, newer.set).start()     # rank 1 never comes; generation 2 begins
    started = time.monotonic()
    with pytest.raises(CollectiveAborted, match="newer generation began while generation 1"):
        collective.form(1, should_abort=newer.is_set)
    assert time.monotonic() - started < 5.0     # not the 30 s group timeout
    assert collective.group is None and collective.generation == -1


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_next_generation_forms_after_an_abandoned_one(store: Callable[[], dist.Store]) -> None:
    """Rank 0 gives up on generation 1 (rank 1 died before joining); both ranks then form
    generation 2 and all-reduce over it."""
    collectives = [Collective(store, rank=r, world_size=2, timeout_s=30.0) for r in (0, 1)]
    with pytest.raises(CollectiveAborted):
        collectives[0].form(1, should_abort=lambda: True)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    started = time.monotonic()

    def rank(r: int) -> None:
        try:
            collectives[r].form(2)
            results[r] = collectives[r].all_reduce(torch.tensor([float(r + 1)]), lambda: False)
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert time.monotonic() - started < 15.0    # not held by generation 1's stuck barrier
    assert results[0].item() == results[1].item() == 3.0
    assert collectives[0].generation == collectives[1].generation == 2
