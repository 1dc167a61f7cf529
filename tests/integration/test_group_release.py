"""Abandoned generations' gloo groups give their sockets back (real gloo, real TCPStore, two
ranks each in its own process: tests/integration/two_ranks.py): re-forming the group many
times does not grow the process's open file descriptors, and a call parked on a hung peer
is aborted once the next group formed, without faulting the new generation."""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

import pytest
import torch

from phalanx.runtime.group.collective import Collective
from phalanx.runtime.group.default_group import DefaultGroup
from tests.integration.two_ranks import Rank, on_ranks

pytestmark = pytest.mark.integration
REFORMS = 8


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(check: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _reform_many_times(rank: Rank) -> dict:
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=20.0)
    rank.keep(collective)
    store = rank.connect()
    collective.form(0)
    collective.all_reduce(torch.ones(4), lambda: False)
    base = _fds()
    counts = []
    for generation in range(1, REFORMS + 1):
        collective.abandon()
        collective.form(generation)
        summed = collective.all_reduce(torch.ones(4), lambda: False)
        assert summed.tolist() == [2.0] * 4
        assert collective.parked == 0
        # each parked gloo group holds ~5 descriptors in each rank's process until it is
        # reaped (a thread, within milliseconds): kept, 8 re-forms would leave ~40 more open
        _settled(lambda: _fds() <= base + 4, 5.0)
        counts.append(_fds())
    rank.meet("counted", store)         # the peer's sockets stay until both counted
    return {"base": base, "counts": counts}


@pytest.mark.timeout(120)
def test_reforming_the_group_many_times_does_not_grow_open_fds() -> None:
    for rank, seen in enumerate(on_ranks(_reform_many_times)):
        base, counts = seen["base"], seen["counts"]
        assert max(counts) <= base + 4, (f"rank {rank}'s open fds grew over {REFORMS} "
                                         f"re-forms from {base}: {counts}")


def _park_on_a_hung_peer(rank: Rank) -> dict:
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=30.0)
    rank.keep(collective)
    store = rank.connect()
    collective.form(0)
    if rank.rank == 1:                  # never joins rank 0's call: "hung", then re-forms
        rank.await_signal("rank0-parked", store)
        collective.abandon()
        collective.form(1)
        return {"summed": collective.all_reduce(torch.ones(4), lambda: False).tolist()}
    group = DefaultGroup(collective, skip_setup=False)
    work = group.allreduce([torch.ones(4)])
    rank.keep(collective, group, work)
    time.sleep(0.1)
    assert not work.is_completed()
    rank.signal("rank0-parked", store)
    collective.abandon()
    started = time.monotonic()
    collective.form(1)
    assert _settled(work.is_completed, 5.0), "the parked call was left to its 30 s timeout"
    released = time.monotonic() - started
    assert collective.fault is None and collective.generation == 1
    summed = collective.all_reduce(torch.ones(4), lambda: False)
    return {"summed": summed.tolist(), "released_s": released}


@pytest.mark.timeout(120)
def test_a_call_parked_on_a_hung_peer_is_released_without_faulting_the_next_generation(
        ) -> None:
    rank0, rank1 = on_ranks(_park_on_a_hung_peer)
    assert rank0["summed"] == rank1["summed"] == [2.0] * 4
    assert rank0["released_s"] < 5.0
    print(f"parked call released {rank0['released_s']:.3f} s after the re-form began")


def _subgroup_parked_on_a_hung_peer(rank: Rank) -> dict:
    """A group made by ``new_group`` (a DDP's group of some ranks) with a call of generation
    0 parked on a hung peer: its first call of generation 1 forms its new group at once."""
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=30.0)
    rank.keep(collective)
    store = rank.connect()
    collective.form(0)
    default = DefaultGroup(collective, skip_setup=False)
    sub = default.new_group([0, 1])
    assert sub is not None
    sub.allreduce([torch.ones(2)]).wait()            # generation 0's subgroup formed
    if rank.rank == 1:
        rank.await_signal("rank0-parked", store)
    else:
        work = sub.allreduce([torch.ones(4)])         # rank 1 never joins it
        rank.keep(work)
        time.sleep(0.1)
        assert not work.is_completed()
        rank.signal("rank0-parked", store)
    collective.abandon()
    collective.form(1)
    started = time.monotonic()
    summed = torch.ones(4)
    sub.allreduce([summed]).wait()
    return {"summed": summed.tolist(), "seconds": time.monotonic() - started}


@pytest.mark.timeout(120)
def test_a_subgroup_re_forms_at_once_after_a_call_parked_on_a_hung_peer() -> None:
    """The old subgroup is dropped by the reaper thread, not by the training thread: there
    its destructor waited for the parked call's 30 s timeout, the peer's new subgroup did
    not form within its own timeout, and a job with DDP on ``new_group`` groups failed its
    recovery (GroupNotReformed)."""
    rank0, rank1 = on_ranks(_subgroup_parked_on_a_hung_peer)
    assert rank0["summed"] == rank1["summed"] == [2.0] * 4
    assert rank0["seconds"] < 10.0 and rank1["seconds"] < 10.0, (rank0, rank1)


class _Probe:
    """Stands for a parked gloo group: records the thread its last reference died on."""

    def __init__(self, seen: list[str]) -> None:
        self._seen = seen

    def abort(self) -> None:
        pass

    def __del__(self) -> None:
        self._seen.append(threading.current_thread().name)


def _last_reference_on_the_reaper(rank: Rank) -> dict:
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=20.0)
    rank.keep(collective)
    collective.form(0)
    seen: list[str] = []
    held = [_Probe(seen)]
    collective.park(held[0])
    time.sleep(0.2)          # a reaper started by park itself has long finished here
    held.clear()             # the caller drops its reference ...
    collective.release_parked()     # ... before the reaper is handed the group
    assert _settled(lambda: bool(seen), 5.0)
    return {"dropped_on": seen}


@pytest.mark.timeout(60)
def test_a_parked_group_is_dropped_on_the_reaper_thread() -> None:
    """The caller's references go before the reaper starts, so the reaper drops the last
    one: a gloo group's destructor waits for a call parked on a hung peer (up to its 30 s
    timeout), and on the training thread it stalled a SubGroup's re-form."""
    for seen in on_ranks(_last_reference_on_the_reaper):
        assert seen["dropped_on"] == ["phalanx-group-reaper-gen0"], seen
