"""One copy per node (``phalanx.runtime.keeper.shared_copies``) on a real Keeper over real
/dev/shm files: a replica's shared ranges hold no pages and read through to the snapshot
that holds them; a claim, a forgotten source, a reader and close() each keep the bytes
right and leave no file behind."""
from __future__ import annotations

import itertools
import mmap
import os
import time
from typing import Iterator

import pytest

from phalanx.configs.errors import SnapshotNotFound
from phalanx.runtime.keeper.daemon import Keeper, SlotBusy, owned_names
from phalanx.runtime.keeper.shared_copies import payload_bytes
from phalanx.runtime.keeper.shm import Held, allocated_bytes
from tests.integration.test_keeper import _write

SHM = "/dev/shm"
SIZE = 1 << 20
HEAD = 2 * mmap.PAGESIZE          # each payload's own first bytes (a header, say)
_names = itertools.count()


@pytest.fixture
def keeper() -> Iterator[Keeper]:
    k = Keeper("a", f"ks{os.getpid()}-{next(_names)}", b"shared-copies-secret-0123456789",
               SHM, slots=2, claim_wait_s=2.0).start()
    try:
        yield k
    finally:
        k.close()
        assert owned_names(SHM, k.prefix) == []


def _pattern(seed: int, n: int = SIZE) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


def _publish(keeper: Keeper, rank: int, step: int, payload: bytes) -> Held:
    """A local rank's worker: claim, write through its own map, publish."""
    slot, path = keeper.claim(rank)
    _write(path, payload)
    keeper.publish(rank, step, slot, f"m{rank}-{step}".encode(), len(payload))
    return _held(keeper, rank, step)


def _held(keeper: Keeper, rank: int, step: int) -> Held:
    return next(h for h in keeper.ready_snapshots() if h.rank == rank and h.step == step)


def _replica(keeper: Keeper, rank: int, step: int, payload: bytes,
             shared: list[tuple[int, int, Held, int]]) -> Held:
    """Store a replica whose ``shared`` (offset, nbytes, held, at) ranges stay references;
    the rest of ``payload`` is written by ``fill``, as the receiver writes what arrives."""
    covered = sorted((o, o + n) for o, n, _, _ in shared)

    def fill(view: memoryview) -> None:
        pos = 0
        for start, end in covered + [(len(payload), len(payload))]:
            view[pos:start] = payload[pos:start]
            pos = end

    keeper.store_replica(rank, step, f"m{rank}-{step}".encode(), len(payload), fill,
                         [(o, n, h, h.manifest, at) for o, n, h, at in shared])
    return _held(keeper, rank, step)


def _read(keeper: Keeper, rank: int, step: int) -> bytes:
    _, held = keeper.pin(rank, step)
    try:
        return payload_bytes(held)
    finally:
        keeper.unpin(held)


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_shared_ranges_hold_no_pages_and_read_through(keeper: Keeper) -> None:
    keeper.alloc(0, SIZE)
    own = _publish(keeper, 0, 1, _pattern(1))
    peer = _pattern(2)[:HEAD] + _pattern(1)[HEAD:]      # same tensors, other header
    replica = _replica(keeper, 1, 1, peer, [(HEAD, SIZE - HEAD, own, HEAD)])
    assert _read(keeper, 1, 1) == peer
    assert allocated_bytes(replica.buf.path) <= HEAD + mmap.PAGESIZE
    assert keeper.stats()["shared_bytes"] == SIZE - HEAD
    assert own.pins == own.ref_pins == 1


def test_a_claim_of_a_shared_slot_waits_for_the_copy_even_when_the_sharer_is_shared(
        keeper: Keeper) -> None:
    """T1 shares rank 0's slot S; T2 shares bytes T1 holds itself (so T2 pins T1). Rank
    0's worker then needs S: T1 copies S's bytes in and lets go of S although T2 still
    pins T1, and every replica reads what it read before."""
    keeper.alloc(0, SIZE)
    base = _pattern(3)
    s1 = _publish(keeper, 0, 1, base)
    half = SIZE // 2
    t1_bytes = _pattern(4)[:half] + base[half:]        # shares S's second half
    t1 = _replica(keeper, 1, 1, t1_bytes, [(half, half, s1, half)])
    t2_bytes = t1_bytes[:HEAD] + _pattern(5)[HEAD:]    # shares T1's own first pages
    t2 = _replica(keeper, 2, 1, t2_bytes[:SIZE], [(0, HEAD, t1, 0)])
    assert t1.ref_pins == 1 and s1.ref_pins == 1
    _publish(keeper, 0, 2, _pattern(6))
    started = time.monotonic()
    _publish(keeper, 0, 3, _pattern(7))                # needs S: T1 copies in first
    assert time.monotonic() - started < 2.0
    assert not t1.refs and t2.refs and s1.ref_pins == 0
    assert _read(keeper, 1, 1) == t1_bytes and _read(keeper, 2, 1) == t2_bytes
    assert allocated_bytes(t1.buf.path) >= SIZE - mmap.PAGESIZE


def test_a_forgotten_source_makes_its_sharers_copy_its_bytes_in(keeper: Keeper) -> None:
    """A replica forgotten (dropped) while another shares its bytes: the sharer copies
    them in, and the forgotten one's memory goes once nothing references it."""
    source_bytes = _pattern(8)
    source = _replica(keeper, 5, 1, source_bytes, [])
    sharer_bytes = _pattern(9)[:HEAD] + source_bytes[HEAD:]
    sharer = _replica(keeper, 6, 1, sharer_bytes, [(HEAD, SIZE - HEAD, source, HEAD)])
    assert keeper.drop(5, below_step=2) == {"local": [], "replica": [1]}
    assert source.doomed
    _wait(lambda: not sharer.refs)
    assert source.pins == 0 and source.buf._mm is None      # unmapped
    assert _read(keeper, 6, 1) == sharer_bytes
    assert keeper.stats()["shared_bytes"] == 0


def test_a_reader_of_a_forgotten_sharer_holds_the_slot_it_reads_through(
        keeper: Keeper) -> None:
    """A restore streams replica T (sharing rank 0's slot S) when T is forgotten: S stays
    unclaimable until that reader is done, then the worker gets it."""
    keeper.alloc(0, SIZE)
    base = _pattern(10)
    s1 = _publish(keeper, 0, 1, base)
    _replica(keeper, 1, 1, base, [(HEAD, SIZE - HEAD, s1, HEAD)])
    _, reading = keeper.pin(1, 1)
    keeper.drop(1, below_step=2)
    assert reading.doomed and reading.refs
    _publish(keeper, 0, 2, _pattern(11))
    with pytest.raises(SlotBusy):
        keeper.claim(0, wait=False)
    keeper._claim_wait_s = 0.3
    with pytest.raises(SlotBusy):
        keeper.claim(0)                                 # S is read through: it waits
    assert payload_bytes(reading) == base               # and the bytes never changed
    keeper.unpin(reading)
    assert s1.pins == 0
    _publish(keeper, 0, 3, _pattern(12))
    with pytest.raises(SnapshotNotFound):
        keeper.pin(1, 1)


def test_close_unmaps_a_forgotten_source_that_is_still_shared(keeper: Keeper) -> None:
    source = _replica(keeper, 5, 1, _pattern(13), [])
    _replica(keeper, 6, 1, _pattern(13), [(HEAD, SIZE - HEAD, source, HEAD)])
    _, reading = keeper.pin(6, 1)       # the sharer copies in, then waits for its reader
    keeper.drop(5, below_step=2)
    assert source.doomed and source.buf._mm is not None
    keeper.close()
    assert source.buf._mm is None and owned_names(SHM, keeper.prefix) == []
    keeper.unpin(reading)


def test_only_the_bytes_shared_with_a_forgotten_source_are_copied_in(keeper: Keeper) -> None:
    """A replica shares most bytes with rank 0's own slot and one tensor with an older
    replica (a constant buffer, say): that replica forgotten, only its tensor is copied in;
    the rest stays shared (measured before: the whole replica was copied, and one copy
    per node was lost at the next turnover)."""
    keeper.alloc(0, SIZE)
    base = _pattern(14)
    own = _publish(keeper, 0, 1, base)
    old = _replica(keeper, 5, 1, _pattern(15), [])
    mixed = _pattern(15)[:HEAD] + base[HEAD:]
    thin = _replica(keeper, 6, 1, mixed, [(0, HEAD, old, 0), (HEAD, SIZE - HEAD, own, HEAD)])
    assert keeper.stats()["shared_bytes"] == SIZE
    keeper.drop(5, below_step=2)
    _wait(lambda: keeper.stats()["shared_bytes"] == SIZE - HEAD)
    assert [r.source for r in thin.refs] == [own] and old.buf._mm is None
    assert _read(keeper, 6, 1) == mixed
    assert allocated_bytes(thin.buf.path) <= 2 * HEAD
