"""A keeper holds the memory of the snapshots a recovery can use, not of every buffer it
ever filled: a full snapshot older than the job's commit point (neither its rank's newest
nor being read) is forgotten, and a buffer that held nothing for ``RELEASE_AFTER_S`` gives
its tmpfs pages back; the writer allocates them again (``reserve_file``) before writing, so
a full tmpfs is a typed error, never a SIGBUS. Slots start without pages. Per-rank
channels and CUDA-pinned slots keep theirs."""
from __future__ import annotations

import itertools
import json
import mmap
import os
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.runtime.base import per_rank_channel
from phalanx.runtime.keeper import daemon
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.shm import reserve_file
from tests.plugins.small_tmpfs import small_tmpfs

SECRET = b"keeper-reclaim-secret-0123456789"
N = 64 << 10
_names = itertools.count()


@pytest.fixture
def keeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Keeper]:
    monkeypatch.setattr(daemon, "RELEASE_AFTER_S", 0.0)    # idle once seen idle
    shm = tmp_path / "shm"
    shm.mkdir()
    with Keeper("n0", f"recl{os.getpid()}-{next(_names)}", SECRET, str(shm), slots=3) as k:
        yield k


def _write(keeper: Keeper, rank: int, step: int, *, releasable: bool = True) -> str:
    """What a worker does: claim, allocate the slot's pages, write through its own map,
    publish. Returns the slot's path."""
    keeper.alloc(rank, N, releasable=releasable)
    slot, path = keeper.claim(rank)
    reserve_file(path, N)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, N, flags=mmap.MAP_SHARED) as mapping:
            mapping[:] = step.to_bytes(8, "little") * (N // 8)
    finally:
        os.close(fd)
    keeper.publish(rank, step, slot, json.dumps({"step": step}).encode(), N)
    return path


def _pages(path: str) -> int:
    return os.stat(path).st_blocks * 512


def _commit(keeper: Keeper, step: int) -> None:
    """The reporter's reads of the commit point: the first forgets and marks idle, the
    next (a heartbeat later) releases what stayed idle."""
    keeper.note_committed(step)
    keeper.note_committed(step)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_slots_start_without_pages_and_the_writer_allocates_them(keeper: Keeper) -> None:
    paths = keeper.alloc(0, N)
    assert len(paths) == 3 and [_pages(p) for p in paths] == [0, 0, 0]
    written = _write(keeper, 0, 1)
    assert _pages(written) >= N and sum(_pages(p) for p in paths) == _pages(written)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_steps_older_than_the_commit_point_are_forgotten_and_their_pages_released(
        keeper: Keeper) -> None:
    first = _write(keeper, 0, 10)
    second = _write(keeper, 0, 20)
    for step in (10, 20):
        keeper.put_replica(1, step, b"{}", bytes(N))
    _commit(keeper, 10)
    assert keeper.holdings()[0]["local"] == [10, 20], "the committed step stays"
    assert keeper.holdings()[1]["replica"] == [10, 20]
    _commit(keeper, 20)
    assert keeper.holdings()[0]["local"] == [20] and keeper.holdings()[1]["replica"] == [20]
    assert _pages(first) == 0 and _pages(second) >= N
    free = [name for name in os.listdir(keeper.shm_dir) if name.startswith(keeper.prefix + "x")]
    held = sum(_pages(os.path.join(keeper.shm_dir, name)) for name in free)
    assert len(free) == 2 and held == N, "the freed replica buffer kept its file, not its pages"
    # the released buffers are written again: the step reads back whole
    third = _write(keeper, 0, 30)
    keeper.put_replica(1, 30, b"{}", (30).to_bytes(8, "little") * (N // 8))
    assert third == first and _pages(third) >= N
    for rank, kind in ((0, "local"), (1, "replica")):
        source, held_step = keeper.pin(rank, 30)
        try:
            view = held_step.buf.view(8)
            assert source == kind and bytes(view) == (30).to_bytes(8, "little")
            view.release()
        finally:
            keeper.unpin(held_step)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_newest_a_read_a_channel_and_a_cuda_slot_keep_their_step(keeper: Keeper) -> None:
    _write(keeper, 0, 5)                      # newest of rank 0, older than the commit point
    _write(keeper, 1, 5)
    _write(keeper, 1, 6)
    _, reading = keeper.pin(1, 5)             # a peer reads step 5 of rank 1
    channel = per_rank_channel(0)
    _write(keeper, channel, 5)
    _write(keeper, channel, 6)
    _write(keeper, 2, 5, releasable=False)    # a CUDA writer registered its maps
    _write(keeper, 2, 6, releasable=False)
    _commit(keeper, 9)
    held = keeper.holdings()
    assert held[0]["local"] == [5] and held[1]["local"] == [5, 6]
    assert held[channel]["local"] == [5, 6] and held[2]["local"] == [5, 6]
    keeper.unpin(reading)
    _commit(keeper, 9)
    assert keeper.holdings()[1]["local"] == [6]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_commit_point_read_back_lower_forgets_nothing_at_or_above_it(keeper: Keeper) -> None:
    _commit(keeper, 50)          # another run's, or one before a rollback
    keeper.note_committed(21)    # read back lower: the floor follows the last read
    for step in (21, 22):
        _write(keeper, 0, step)
    _commit(keeper, 21)
    assert keeper.holdings()[0]["local"] == [21, 22]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_full_tmpfs_is_a_typed_error_when_a_released_slot_is_written(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", 8) as folder:
        path = os.path.join(folder, "slot")
        with open(path, "wb") as fh:
            fh.truncate(6 << 20)
        filler = os.path.join(folder, "other-tenant")
        with open(filler, "wb") as fh:
            fh.write(bytes(4 << 20))
        with pytest.raises(ConfigError) as info:
            reserve_file(path, 6 << 20)
        assert info.value.key == "snapshot.shm_dir" and "no space" in str(info.value)
        os.unlink(filler)
        reserve_file(path, 6 << 20)
        assert _pages(path) == 6 << 20
