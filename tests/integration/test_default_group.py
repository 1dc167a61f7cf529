"""The default group over real gloo groups on a real TCPStore (two ranks as threads of this
process): collectives forwarded to the generation's group, re-formed in place (the same
object keeps working in the next generation), a collective stuck on a hung peer completed
as a no-op the moment a newer generation is announced, a failure raised when no Session
absorbs it, and a joining rank's set-up collectives answered locally."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.group.collective import Collective, CollectiveAborted
from phalanx.runtime.group.default_group import DefaultGroup


def on_both(fn: Callable[[int], Any]) -> dict[int, Any]:
    """Run ``fn(rank)`` for ranks 0 and 1 at once; re-raise the first error."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:   # reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


def two_groups(store: Callable[[], dist.Store], generation: int = 0
               ) -> tuple[list[Collective], list[DefaultGroup]]:
    collectives = [Collective(store, rank=r, world_size=2, timeout_s=20.0) for r in (0, 1)]
    on_both(lambda r: collectives[r].form(generation))
    return collectives, [DefaultGroup(c, skip_setup=False) for c in collectives]


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_collectives_run_on_each_generation_through_the_same_group_object(
        store: Callable[[], dist.Store]) -> None:
    collectives, groups = two_groups(store)

    def collectives_of(rank: int) -> tuple[list[float], list[float], list[list[float]]]:
        group = groups[rank]
        summed = torch.tensor([float(rank + 1)] * 3)
        group.allreduce([summed]).wait()
        sent = torch.arange(3.0) * (rank + 1)
        group.broadcast([sent]).wait()
        gathered = [torch.zeros(2) for _ in range(2)]
        group.allgather([gathered], [torch.full((2,), float(rank))]).wait()
        group.barrier().wait()
        return summed.tolist(), sent.tolist(), [g.tolist() for g in gathered]

    first = on_both(collectives_of)
    assert first[0] == first[1] == ([3.0] * 3, [0.0, 1.0, 2.0], [[0.0, 0.0], [1.0, 1.0]])
    for collective in collectives:      # a recovery: abandon, re-form generation 1
        collective.abandon()
    on_both(lambda r: collectives[r].form(1))
    assert on_both(collectives_of) == first
    assert all(c.generation == 1 and c.fault is None for c in collectives)


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_collective_waiting_on_a_hung_peer_completes_as_a_no_op_on_a_newer_generation(
        store: Callable[[], dist.Store]) -> None:
    collectives, groups = two_groups(store)
    newer = threading.Event()
    collectives[0].absorb_faults = True
    collectives[0].superseded = newer.is_set
    tensor = torch.tensor([5.0])
    work = groups[0].allreduce([tensor])        # rank 1 never joins: it "hung"
    time.sleep(0.3)
    assert not work.is_completed()
    newer.set()                                 # the coordinator announced generation 1
    assert work.get_future().wait() == [tensor]
    assert tensor.tolist() == [5.0]             # untouched: the step is rolled back
    assert collectives[0].fault is not None and "newer generation" in collectives[0].fault
    # later collectives of the faulted generation complete at once, never reaching gloo
    again = torch.tensor([1.0])
    assert groups[0].allreduce([again]).is_completed() and again.tolist() == [1.0]


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_without_a_session_a_failed_generation_raises(store: Callable[[], dist.Store]) -> None:
    collectives, groups = two_groups(store)
    collectives[0].mark_fault("peer died")
    with pytest.raises(CollectiveAborted, match="peer died"):
        groups[0].allreduce([torch.ones(1)])


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_joining_rank_answers_set_up_collectives_alone_until_started(
        store: Callable[[], dist.Store]) -> None:
    collectives, _ = two_groups(store)
    joining = DefaultGroup(collectives[1], skip_setup=True)
    gathered = [torch.zeros(2) for _ in range(2)]
    joining.allgather([gathered], [torch.full((2,), 7.0)]).wait()   # DDP's shape check
    assert [g.tolist() for g in gathered] == [[7.0, 7.0], [7.0, 7.0]]
    weights = torch.tensor([1.0, 2.0])
    joining.broadcast([weights]).wait()           # DDP's state broadcast: restored instead
    assert weights.tolist() == [1.0, 2.0]
    joining.started()                              # the Session started: real from now on
    rank0 = DefaultGroup(collectives[0], skip_setup=False)
    summed = on_both(lambda r: ((rank0, joining)[r].allreduce([t := torch.ones(1)]).wait(),
                                t.item())[1])
    assert summed == {0: 2.0, 1: 2.0}
