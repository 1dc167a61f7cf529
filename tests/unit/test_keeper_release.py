"""A keeper gives back the memory of ranks that left it: after a new placement
(``Keeper.retarget``) the slots of a rank now on another node and the replicas of a rank
it no longer holds stay until the job commits a newer step, then their files go; a rank
that comes back (``alloc``) keeps its slots; a reader's map stays valid until it unpins;
a slot file unlinked under a worker that is mapping it is replaced, never handed out."""
from __future__ import annotations

import itertools
import json
import mmap
import os
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.shm import map_slots

SECRET = b"keeper-release-secret-0123456789"
N = 8192
_names = itertools.count()


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Keeper]:
    shm = tmp_path / "shm"
    shm.mkdir()
    with Keeper("n0", f"rel{os.getpid()}-{next(_names)}", SECRET, str(shm), slots=3) as k:
        yield k


def _snapshot(keeper: Keeper, rank: int, step: int) -> None:
    keeper.alloc(rank, N)
    slot, path = keeper.claim(rank)
    with open(path, "r+b") as fh:
        fh.write(step.to_bytes(8, "little") * (N // 8))
    keeper.publish(rank, step, slot, json.dumps({"step": step}).encode(), N)


def _files(keeper: Keeper) -> dict[str, int]:
    """Files per kind: ``r<rank>`` slots, ``x`` replica buffers."""
    counts: dict[str, int] = {}
    for name in os.listdir(keeper.shm_dir):
        suffix = name[len(keeper.prefix):]
        key = suffix.split("-")[0] if suffix.startswith("r") else "x"
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_departed_rank_and_stale_replicas_are_freed_after_a_newer_commit(keeper: Keeper) -> None:
    for rank in (0, 2):
        _snapshot(keeper, rank, 5)
    for rank in (1, 3):
        for step in (4, 5):
            keeper.put_replica(rank, step, b"{}", bytes(N))
    keeper.note_committed(5)
    assert _files(keeper) == {"r0": 3, "r2": 3, "x": 4}
    keeper.retarget(local_ranks=[0], replica_ranks=[1])    # rank 2 moved, rank 3 re-placed
    keeper.note_committed(5)
    assert _files(keeper) == {"r0": 3, "r2": 3, "x": 4}, "kept until the new owners commit"
    assert sorted(keeper.holdings()) == [0, 1, 2, 3]
    keeper.note_committed(6)
    assert _files(keeper) == {"r0": 3, "x": 2}
    assert sorted(keeper.holdings()) == [0, 1]
    assert keeper.stats()["files"] == 5 and keeper.stats()["ranks_replica"] == 1


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_rank_that_comes_back_keeps_its_slots(keeper: Keeper) -> None:
    _snapshot(keeper, 0, 3)
    keeper.retarget(local_ranks=[], replica_ranks=[])
    paths = keeper.alloc(0, N)                 # a spare on this node took rank 0 again
    keeper.note_committed(4)
    assert all(os.path.exists(p) for p in paths) and keeper.holdings()[0]["local"] == [3]
    keeper.retarget(local_ranks=[0], replica_ranks=[])
    keeper.note_committed(9)
    assert _files(keeper) == {"r0": 3}


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_pinned_departed_slot_stays_readable_until_unpinned(keeper: Keeper) -> None:
    _snapshot(keeper, 2, 7)
    _, held = keeper.pin(2, 7)               # a peer streaming rank 2 to its new owner
    view = held.buf.view(N)
    keeper.retarget(local_ranks=[], replica_ranks=[])
    keeper.note_committed(8)
    assert _files(keeper) == {} and keeper.holdings() == {}
    assert bytes(view[:8]) == (7).to_bytes(8, "little")
    view.release()
    keeper.unpin(held)
    assert held.buf._mm is None              # unmapped once its reader let go


def _open_map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_slot_file_removed_as_a_restarted_worker_maps_it_is_replaced(keeper: Keeper) -> None:
    """The race of a restarted worker's re-allocation with the clean-up of the dead
    worker's files (``/dev/shm/phalanx-demo-node1-r1-v1-s0`` gone under the mapping)."""
    first = keeper.alloc(1, N)
    answers: list[list[str]] = []
    closed: list[mmap.mmap] = []

    def alloc() -> list[str]:
        answers.append(keeper.alloc(1, N))
        if len(answers) == 1:
            os.unlink(answers[0][-1])       # the clean-up lands between answer and map
        return answers[-1]

    maps = map_slots(alloc, N, _open_map, lambda m: (closed.append(m), m.close()))
    assert answers[0] == first and len(answers) == 2
    assert sorted(maps) == sorted(answers[1]) and not set(answers[1]) & set(first)
    assert all(os.path.exists(p) and "-v1-" in p for p in maps)
    assert len(closed) == 2 and all(m.closed for m in closed)   # the first try's maps
    slot, path = keeper.claim(1)
    assert path in maps
    for mapping in maps.values():
        mapping.close()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_late_commit_of_a_held_step_keeps_it_for_the_restore(keeper: Keeper) -> None:
    """A node lost at step 20: this keeper holds rank 1's replicas of steps 19 and 20, the
    new placement gives rank 1 (now here, restored from them) no holders; the commit of
    step 20 lands only after the placement. Step 20 stays until step 21 commits."""
    for step in (19, 20):
        keeper.put_replica(1, step, b"{}", bytes(N))
    keeper.note_committed(19)
    keeper.retarget(local_ranks=[0, 1], replica_ranks=[])
    keeper.note_committed(20)
    assert keeper.holdings()[1]["replica"] == [20]       # (19 is older than the commit point)
    _, held = keeper.pin(1, 20)          # the restore reads it
    keeper.unpin(held)
    keeper.note_committed(21)
    assert 1 not in keeper.holdings() and _files(keeper) == {}
