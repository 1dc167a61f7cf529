"""The session's collective on a real TCPStore and real gloo groups: formation that a newer
generation (or a peer that never comes) interrupts at once, and groups that form normally
(two ranks, each in its own process: tests/integration/two_ranks.py)."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.group.collective import Collective, CollectiveAborted
from tests.integration.two_ranks import Rank, on_ranks


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


def _after_an_abandoned_generation(rank: Rank) -> dict:
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=30.0)
    rank.keep(collective)
    store = rank.connect()
    if rank.rank == 0:                  # gives up on generation 1: rank 1 never joins it
        with pytest.raises(CollectiveAborted):
            collective.form(1, should_abort=lambda: True)
        rank.signal("generation1-abandoned", store)
    else:
        rank.await_signal("generation1-abandoned", store)
    started = time.monotonic()
    collective.form(2)
    summed = collective.all_reduce(torch.tensor([float(rank.rank + 1)]), lambda: False)
    return {"summed": summed.item(), "generation": collective.generation,
            "seconds": time.monotonic() - started}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_next_generation_forms_after_an_abandoned_one() -> None:
    """Rank 0 gives up on generation 1 (rank 1 died before joining); both ranks then form
    generation 2 and all-reduce over it."""
    seen = on_ranks(_after_an_abandoned_generation)
    assert [s["summed"] for s in seen] == [3.0, 3.0]
    assert [s["generation"] for s in seen] == [2, 2]
    # not held by generation 1's stuck barrier (30 s)
    assert all(s["seconds"] < 15.0 for s in seen), seen
