"""Captures through a real in-process keeper: what the keeper serves verifies (checksums and
HMAC) and equals the live state bit for bit — for CPU state (fused copy + checksum on
background threads) and, on a GPU host, for CUDA state (checksums follow the
device-to-host copies, event by event)."""
from __future__ import annotations

import contextlib
import secrets
import time
from typing import Iterator

import pytest
import torch

import phalanx.runtime.snapshot.snapshotter as snapshotter_module
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.format import read_tensors, verify_snapshot
from phalanx.runtime.snapshot.snapshotter import SnapshotPolicy, Snapshotter
from phalanx.runtime.snapshot.state_tree import RNGState, flatten_state

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SECRET = b"k" * 32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def capture_and_check(objects: dict, workers: int, inline: bool = False,
                      steps: tuple[int, ...] = (1, 2)) -> int:
    """Capture ``objects`` at ``steps`` (each slot at least once for two), then check what
    the keeper serves."""
    job = f"cap{secrets.token_hex(3)}"
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1), checksum_workers=workers,
                           inline=inline)
        try:
            for step in steps:
                snap.capture(step, objects)
                snap.wait_for_copy()
                snap.flush()
            reader = KeeperClient(*keeper.address, SECRET, job)
            step, manifest, payload = reader.get(0)
            reader.close()
        finally:
            snap.close()
            client.close()
    parsed = verify_snapshot(payload, manifest, secret=SECRET, source="keeper")
    assert parsed.step == steps[-1]
    assert all(rec["checksum"].startswith("xxh3:") for rec in parsed.tensors.values())
    live, _ = flatten_state(objects)
    served = read_tensors(payload, parsed)
    assert served.keys() == live.keys()
    assert all(same_bits(live[k].cpu(), served[k]) for k in live)
    return step


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_cpu_capture_is_served_verified_and_bit_identical(workers: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(700, 800), torch.nn.Linear(800, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 700)).sum().backward()
    optimizer.step()
    assert capture_and_check({"model": model, "optimizer": optimizer}, workers) == 2


def test_inline_captures_publish_without_a_round_trip_and_write_the_slot_the_reply_named(
        ) -> None:
    """The per-rank channel's captures: copied on the training thread, the publish sent
    without waiting (the keeper has it although the writer never read a reply), the next
    capture written into the slot that reply claimed; what is served is bit-identical."""
    job = f"inl{secrets.token_hex(3)}"
    objects = {"rng": RNGState(), "t": torch.arange(300, dtype=torch.float64)}
    with Keeper("node0", job, SECRET, slots=3) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=5, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1), checksum_workers=1, inline=True)
        claims: list[int] = []
        real_claim = client.claim
        client.claim = lambda *a, **k: claims.append(1) or real_claim(*a, **k)  # type: ignore
        reader = KeeperClient(*keeper.address, SECRET, job)
        try:
            for step in range(1, 8):
                objects["t"].add_(1)
                snap.capture(step, objects)
                deadline = time.monotonic() + 5
                while reader.latest(5) != step:       # published with no reply read
                    assert time.monotonic() < deadline, reader.holdings()
                    time.sleep(0.005)
            assert len(claims) == 1                   # only the first capture asked for one
            held = reader.holdings()[5]
            # the third slot is already the next capture's (claimed by the last reply)
            assert sorted(held["local"]) == [6, 7] and held["writing"]
            step, manifest, payload = reader.get(5)
        finally:
            reader.close()
            snap.close()
            client.close()
    parsed = verify_snapshot(payload, manifest, secret=SECRET, source="keeper")
    served = read_tensors(payload, parsed)
    assert step == 7 and same_bits(served["t"], objects["t"])


@pytest.mark.parametrize("steps", [(1, 2), (1, 2, 3, 4, 5)])
def test_inline_capture_is_served_verified_and_bit_identical(steps: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = torch.nn.BatchNorm1d(64)
    model(torch.randn(8, 64))
    assert capture_and_check({"model": model, "rng": RNGState()}, 1, inline=True,
                             steps=steps) == steps[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capture_hashes_each_part_as_it_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshotter_module, "MARK_BYTES", 1 << 20)   # several events
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4))).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    assert capture_and_check({"model": model, "optimizer": optimizer}, 2) == 2


AUTO_STATE = {"t": torch.ones(4096)}


@contextlib.contextmanager
def auto_snapshotter(captures: int = 4) -> Iterator[tuple[Keeper, KeeperClient, Snapshotter,
                                                          int]]:
    """A keeper, a client and an ``auto`` snapshotter of a 16 KiB state at 50 ms steps,
    after ``captures`` captures (steps 1, 2, ...): (keeper, client, snapshotter, the
    interval those alone asked for)."""
    job = f"auto{secrets.token_hex(3)}"
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps="auto", overhead_budget=0.03))
        try:
            snap.observe_step(1.0)     # a process's first step: no steady step, not counted
            snap.observe_step(0.05)
            for step in range(1, captures + 1):
                snap.capture(step, AUTO_STATE)
                snap.flush()
            yield keeper, client, snap, snap.wanted_interval
        finally:
            snap.close()
            client.close()


def test_auto_asks_for_no_interval_until_a_capture_is_measured() -> None:
    """Before its snapshots' cost is known an ``auto`` snapshotter snapshots every step on
    its own, but asks the other ranks for no interval (0: ``Session._agree_interval``
    leaves the choice to ranks that measured); the first capture, which allocates the
    slots, measures nothing. ``measure_next`` makes the next step due once, and a skipped
    step (its keeper gone, no room) counts as that capture, as it does on the other ranks:
    else this rank alone would go on finding every step due."""
    with auto_snapshotter(captures=0) as (_, _, snap, _):
        asked = [(snap.interval, snap.wanted_interval)]
        for step in (1, 2):
            snap.capture(step, AUTO_STATE)
            snap.flush()
            asked.append((snap.interval, snap.wanted_interval))
        snap.agree_interval(100)
        snap.measure_next()
        forced = snap.due(3)
        snap.skip(3)      # no room or no keeper: counted as taken, as on the other ranks
        after_skip = snap.due(4)
    assert asked[:2] == [(1, 0), (1, 0)]
    assert asked[2][1] == asked[2][0] >= 1
    assert forced and not after_skip


def test_auto_counts_the_keepers_replica_pushes_as_snapshot_cost() -> None:
    """``every_steps: auto`` keeps the whole cost of a snapshot under budget, and pushing
    it to the replica holders is part of that cost (the keeper reports it at each claim)."""
    with auto_snapshotter() as (keeper, client, snap, alone):
        keeper.record_push(0, "node1", 0.2)          # each replica push takes 0.2 s
        for step in range(5, 10):
            snap.capture(step, AUTO_STATE)
            snap.flush()
        assert client.replication_s == pytest.approx(0.2)
    assert alone < 20                               # a 16 KiB capture is cheap
    assert snap.wanted_interval >= 0.2 * 0.5 / (0.03 * 0.05)   # the pushes dominate now


def test_auto_counts_tier_writes_once_each() -> None:
    """A tier's write of a rank's snapshot is a cost of snapshotting too (a tier at
    ``every_steps: auto`` persists every full snapshot): the keeper tells it at the next
    claim, once, so the interval stretches while a second claim sees none of it."""
    with auto_snapshotter() as (keeper, client, snap, alone):
        told = []
        for step in range(5, 10):
            keeper.record_tier_work(0, 0.1)            # a write of 0.1 s per snapshot,
            keeper.record_tier_work(0, 0.2)            # and another tier's of 0.2 s
            keeper.record_tier_work(1, 5.0)            # another rank's writes are not ours
            snap.capture(step, AUTO_STATE)
            snap.flush()
            told.append(client.tier_s)
        snap.capture(10, AUTO_STATE)                   # nothing written since the last claim
        snap.flush()
        assert client.tier_s == 0.0
    assert told == [pytest.approx(0.3)] * 5
    assert alone < 20
    assert snap.wanted_interval >= 0.3 * 0.5 / (0.03 * 0.05)
