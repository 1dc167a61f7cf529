"""The tier persister's choices over real keeper slots in a temp folder (no sockets): which
steps a tier persists and that every node picks the same ones, wall-clock windows, a slow
tier with 2 slots, checksum verification, and retention moving with rank 0."""
from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from phalanx.configs.errors import SnapshotNotFound
from phalanx.configs.schema import (DiskTierConfig, JobConfig, PhalanxConfig, SnapshotConfig,
                                    TiersConfig)
from phalanx.runtime.keeper.daemon import Keeper, SlotBusy
from phalanx.runtime.tiers.persister import TierPersister, pick_step
from phalanx.runtime.snapshot.format import checksums, make_manifest, plan_layout, write_into
from tests.fakes.tier_memory import MemoryTier
from tests.integration.test_persister import Events

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SECRET = b"cadence-test-secret-0123456789ab"
JOB = "cadence"


def _tensors(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((16, 8), float(rank * 1000 + step)),
            "i": torch.arange(5, dtype=torch.int64) + step}


class CountingKeeper(Keeper):
    """A keeper (never served over TCP) that counts the persister's polls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.polls = 0

    def holdings(self) -> dict[int, dict[str, Any]]:
        self.polls += 1
        return super().holdings()

    def wait_polls(self, count: int = 2) -> None:
        """Until ``count`` more polls began: the persister has seen what is held now."""
        target = self.polls + count
        _wait(lambda: self.polls >= target, f"{count} polls of keeper {self.node}")


def publish(keeper: Keeper, rank: int, step: int, flip: str | None = None,
            claimed: tuple[int, str] | None = None) -> None:
    """What a worker does: claim a slot (unless ``claimed``), write through its own mmap,
    publish. ``flip`` names a tensor whose first byte is flipped after the checksums."""
    tensors = _tensors(rank, step)
    layout = plan_layout(tensors)
    keeper.alloc(rank, layout.total_bytes)
    slot, path = claimed or keeper.claim(rank)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, layout.total_bytes) as mm:
            write_into(mm, layout, tensors)
            sums = checksums(mm, layout)
            if flip is not None:
                mm[layout.data_start + layout.entries[flip].begin] ^= 0xFF
    finally:
        os.close(fd)
    manifest = make_manifest(layout, sums, job=JOB, rank=rank, step=step, generation=1,
                             tree_spec={"step": step}, created_at=time.time())
    keeper.publish(rank, step, slot, manifest.sign(SECRET).to_json(), layout.total_bytes)


def _wait(predicate: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class Node:
    def __init__(self, root: Path, name: str, ranks: list[int], tiers: list, world: list[int],
                 *, slots: int = 3, claim_wait_s: float = 5.0,
                 keeper_class: type[Keeper] = CountingKeeper, **persister: Any) -> None:
        shm = root / name
        shm.mkdir()
        self.ranks = ranks
        self.keeper = keeper_class(name, JOB, SECRET, str(shm), slots=slots,
                                   claim_wait_s=claim_wait_s)
        self.events = Events()
        self.persister = TierPersister(self.keeper, tiers, world, ranks, poll_s=0.002,
                                       on_event=self.events, commit_retry_s=0.002, **persister)

    def publish(self, step: int) -> None:
        for rank in self.ranks:
            publish(self.keeper, rank, step)

    def steps(self, kind: str) -> list[int]:
        return [e["step"] for e in self.events.of(kind)]

    def close(self) -> None:
        self.persister.close()
        self.keeper.close()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(*args: Any, **kwargs: Any) -> Node:
        made.append(Node(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for node in made:
        node.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("persister-")]


# --- the pure rule ------------------------------------------------------------------------

@pytest.mark.parametrize(("ready", "attempted", "time_due", "want"), [
    ({3, 6}, 0, False, None),              # window 0 is never persisted
    ({18, 21}, 0, False, 21),              # the first snapshot step of window [20, 40)
    ({21, 24}, 0, False, 21),              # still held: every node picks 21
    ({24, 27}, 0, False, 24),              # 21 missed here: a later step (never commits)
    ({39, 42}, 21, False, 42),             # the newest window's first held step
    ({39, 42}, 0, False, 42),              # not 39: its window's first step was missed
    ({24, 27}, 21, False, None),           # window 1 already tried
    ({24, 27}, 21, True, 24),              # a wall-clock window: oldest newer held step
    ({18, 21}, 21, True, None),            # nothing newer than the last attempt
    ({30, 33}, 42, False, None),           # after a rollback: wait past the last attempt
    ({40}, 0, False, 40),
])
def test_pick_step_takes_the_first_step_of_each_window(ready: set[int], attempted: int,
                                                        time_due: bool, want: int | None) -> None:
    assert pick_step(ready, attempted, 20, time_due) == want


def test_pick_step_walks_a_schedule_of_3_onto_windows_of_20() -> None:
    attempted, picked = 0, []
    for newest in range(0, 130, 3):
        step = pick_step({newest - 3, newest} - {-3}, attempted, 20)
        if step is not None:
            attempted = step
            picked.append(step)
    assert picked == [21, 42, 60, 81, 102, 120]


def test_pick_step_without_windows_takes_every_snapshot_oldest_first() -> None:
    """``every_steps`` 0 (a tier at auto under an auto snapshot interval): every full
    snapshot is persisted; a step missed (no longer held) is skipped, never waited for."""
    assert pick_step({3, 6}, 0, 0) == 3
    assert pick_step({3, 6}, 3, 0) == 6
    assert pick_step({3, 6}, 6, 0) is None
    assert pick_step({9, 12}, 3, 0) == 9            # 6 went before this node's poll
    assert pick_step(set(), 0, 0) is None


# --- cadence across nodes -----------------------------------------------------------------

def test_two_nodes_with_an_auto_tier_commit_every_snapshot_step(nodes) -> None:
    tier = MemoryTier(JOB)
    world = [0, 1]
    n0 = nodes("n0", [0], [(tier, 0, 10)], world)
    n1 = nodes("n1", [1], [(tier, 0, 10)], world)
    for node in (n0, n1):
        node.persister.start()
    steps = [7, 19, 40, 41, 90]                      # an auto interval that moves
    for step in steps:
        for node in (n0, n1):
            node.publish(step)
        for node in (n0, n1):
            node.keeper.wait_polls()
    _wait(lambda: tier.committed_steps() == steps, f"commits of {steps}")
    for node in (n0, n1):
        assert node.steps("tier_persisted") == steps
        assert node.keeper.take_tier_work(node.ranks[0]) > 0   # told to the writer
        assert node.keeper.take_tier_work(node.ranks[0]) == 0  # once



def test_two_nodes_snapshotting_every_3_commit_the_same_steps_every_20(nodes) -> None:
    tier = MemoryTier(JOB)  # one shared store, as S3 or a shared disk would be
    world = [0, 1, 2, 3]
    n0 = nodes("n0", [0, 2], [(tier, 20, 10)], world)
    n1 = nodes("n1", [1, 3], [(tier, 20, 10)], world)
    for node in (n0, n1):
        node.persister.start()
    for step in range(0, 130, 3):    # snapshot.every_steps: 3 from step 0
        for node in (n0, n1):
            node.publish(step)
        for node in (n0, n1):
            node.keeper.wait_polls()
    want = [21, 42, 60, 81, 102, 120]
    _wait(lambda: tier.committed_steps() == want, f"commits of {want}")
    for node in (n0, n1):
        assert node.steps("tier_persisted") == want
        _wait(lambda: node.persister.last_committed() == {"memory": 120}, "both see 120")
        assert node.events.of("tier_skipped") == [] and node.events.of("persister_error") == []


def test_every_s_opens_wall_clock_windows_when_steps_are_far_apart(nodes) -> None:
    now = [1000.0]
    tier = MemoryTier(JOB)
    node = nodes("n0", [0], [(tier, 1000, 5, 10.0)], [0], wall_clock=lambda: now[0])
    node.persister.start()
    node.publish(1)
    node.keeper.wait_polls()
    assert node.steps("tier_persisted") == []       # the window it started in
    now[0] = 1010.0                                  # a new 10 s window
    _wait(lambda: tier.committed_steps() == [1], "step 1 committed")
    for step in (2, 3):
        node.publish(step)
    node.keeper.wait_polls()
    assert node.steps("tier_persisted") == [1]       # same window: nothing new
    now[0] = 1025.0
    _wait(lambda: tier.committed_steps() == [1, 2], "step 2 committed")
    assert node.steps("tier_persisted") == [1, 2]    # the oldest held step newer than 1


def test_tier_specs_pass_every_s_through(tmp_path: Path) -> None:
    from phalanx.runtime.tiers.config import build_tiers, tier_specs

    cfg = PhalanxConfig(job=JobConfig(entrypoint="x.py:main", name=JOB),
                        tiers=TiersConfig(disk=DiskTierConfig(every_steps=7, every_s=30.0,
                                                              keep=3)))
    [(tier, every, keep, every_s)] = tier_specs(cfg, str(tmp_path))
    assert (tier.name, every, keep, every_s) == ("disk", 7, 3, 30.0)
    assert [spec[1:] for spec in build_tiers(cfg, str(tmp_path))] == [(7, 3)]


def test_tier_specs_resolve_auto_by_the_snapshot_interval(tmp_path: Path) -> None:
    """A tier at ``every_steps: auto`` persists every full snapshot (window 0) when the
    snapshot interval is auto, and falls back to its old default window when it is fixed."""
    from phalanx.runtime.tiers.config import tier_specs

    def windows(snapshot_every: int | str) -> list[int]:
        cfg = PhalanxConfig(job=JobConfig(entrypoint="x.py:main", name=JOB),
                            snapshot=SnapshotConfig(every_steps=snapshot_every))
        return [spec[1] for spec in tier_specs(cfg, str(tmp_path))]

    assert PhalanxConfig(job=JobConfig(entrypoint="x.py:main")).tiers.disk.every_steps == "auto"
    assert windows("auto") == [0]
    assert windows(5) == [50]


# --- a slow tier with 2 slots ---------------------------------------------------------------

class SlowTier(MemoryTier):
    def __init__(self, delay_s: float) -> None:
        super().__init__(JOB)
        self.delay_s = delay_s

    def write_rank(self, step: int, rank: int, payload: Any, manifest: bytes) -> None:
        time.sleep(self.delay_s)
        super().write_rank(step, rank, payload, manifest)


def test_slow_tier_with_two_slots_never_blocks_the_worker(nodes) -> None:
    tier = SlowTier(delay_s=0.5)                     # each write outlasts claim_wait_s
    node = nodes("n0", [0], [(tier, 1, 5)], [0], slots=2, claim_wait_s=0.2)
    node.persister.start()
    for step in range(1, 16):
        try:
            node.publish(step)                       # claims every 0.05 s, like a worker
        except SlotBusy as exc:
            pytest.fail(f"the persister blocked the worker at step {step}: {exc}")
        time.sleep(0.05)
    _wait(lambda: len(tier.committed_steps()) >= 2, "two committed steps")
    assert node.events.of("persister_error") == []


class PreemptingKeeper(CountingKeeper):
    """The worker claims (from another thread) right after the persister pinned a step
    with a yielding pin, and the pin returns once that claim asked it to give way."""

    claimed: list[Any]

    def pin(self, rank: int, step: int | None = None, *,
            on_claim: Callable[[], None] | None = None) -> tuple[str, Any]:
        source, held = super().pin(rank, step, on_claim=on_claim)
        if on_claim is not None and not hasattr(self, "claimed"):
            self.claimed = []
            claim = threading.Thread(target=lambda: self.claimed.append(self.claim(rank)))
            claim.start()
            _wait(lambda: held.yielding == [], "the claim preempting the pin")
        return source, held


def test_claim_mid_copy_preempts_the_pin_and_skips_that_step(nodes) -> None:
    tier = MemoryTier(JOB)
    node = nodes("n0", [0], [(tier, 5, 5)], [0], slots=2, claim_wait_s=5.0,
                 keeper_class=PreemptingKeeper)
    for step in (5, 6):                              # 5 is the slot a claim may take
        node.publish(step)
    started = time.monotonic()
    node.persister.start()
    _wait(lambda: node.events.of("tier_skipped"), "step 5 skipped")
    _wait(lambda: node.keeper.claimed, "the worker's claim")
    assert time.monotonic() - started < 2.0, "the claim waited for the whole tier write"
    [skipped] = node.events.of("tier_skipped")
    assert (skipped["step"], skipped["rank"], skipped["cause"]) == (5, 0, "preempted")
    assert node.persister.skipped() == {"memory": 1}
    with pytest.raises(SnapshotNotFound):
        tier.read_rank(5, 0)
    publish(node.keeper, 0, 7, claimed=node.keeper.claimed[0])  # fill the slot it won
    for step in (8, 9, 10):
        node.publish(step)
    _wait(lambda: tier.committed_steps() == [10], "the next due step, 10, committed")


# --- checksums ------------------------------------------------------------------------------

@pytest.mark.parametrize("slots", [2, 3])
def test_a_flipped_byte_is_not_persisted_and_the_event_names_the_tensor(nodes,
                                                                       slots: int) -> None:
    tier = MemoryTier(JOB)
    node = nodes("n0", [0, 1], [(tier, 5, 5)], [0, 1], slots=slots)
    node.persister.start()
    for step in range(1, 5):
        node.publish(step)
    publish(node.keeper, 0, 5)
    publish(node.keeper, 1, 5, flip="w")             # rank 1's slot no longer matches
    _wait(lambda: node.events.of("tier_skipped"), "step 5 skipped")
    [skipped] = node.events.of("tier_skipped")
    assert (skipped["step"], skipped["rank"], skipped["tensor"]) == (5, 1, "w")
    assert skipped["cause"] == "corrupt" and "checksum mismatch" in skipped["reason"]
    with pytest.raises(SnapshotNotFound):
        tier.read_rank(5, 1)
    for step in range(6, 11):
        node.publish(step)
    _wait(lambda: tier.committed_steps() == [10], "step 10 committed")
    assert 5 not in node.steps("tier_committed") and 5 not in node.steps("tier_persisted")


# --- retention follows rank 0 ---------------------------------------------------------------

def test_retention_moves_to_the_node_that_now_holds_rank_0(nodes) -> None:
    tier = MemoryTier(JOB)
    n0 = nodes("n0", [0], [(tier, 5, 1)], [0, 1])
    n1 = nodes("n1", [1], [(tier, 5, 1)], [0, 1])
    for node in (n0, n1):
        node.persister.start()
        for step in range(1, 6):
            node.publish(step)
    _wait(lambda: n1.persister.last_committed() == {"memory": 5}, "step 5 committed")
    n0.close()                                       # rank 0's node is lost ...
    n1.ranks = [0, 1]                                # ... and rank 0 restarts on n1
    n1.persister.set_local_ranks(n1.ranks)
    for step in range(6, 11):
        n1.publish(step)
    _wait(lambda: tier.committed_steps() == [10], "retention keeping only step 10")
    assert [e["deleted"] for e in n1.events.of("tier_retention")] == [[5]]
