"""A published snapshot equals the state at its step boundary: a captured tensor written in
place before the background copy was over (outside the fenced optimizer step) makes the
snapshot torn and it is never published as that step; gradients accumulated across
``session.step()`` calls are refused; numpy Generators are captured and restored."""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import phalanx.runtime.snapshot.checksum as checksum_module
import phalanx.runtime.snapshot.copy_check as copy_check_module
import phalanx.runtime.snapshot.snapshotter as snapshotter_module
from phalanx.configs.errors import StateNotCapturable
from phalanx.runtime.base import KeeperCopy, NodeId
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.copy_check import CopyCheck
from phalanx.runtime.snapshot.format import read_tensors, verify_snapshot
from phalanx.runtime.snapshot.snapshotter import SnapshotPolicy, Snapshotter
from phalanx.runtime.snapshot.state_tree import flatten_state, unflatten_state
from phalanx.runtime.worker.session import Session

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SECRET = secrets.token_bytes(32)


def served(keeper: Keeper, job: str) -> tuple[int, dict[str, torch.Tensor]]:
    """The newest step rank 0's keeper serves, and its tensors (verified)."""
    reader = KeeperClient(*keeper.address, SECRET, job)
    try:
        step, manifest, payload = reader.get(0)
    finally:
        reader.close()
    parsed = verify_snapshot(payload, manifest, secret=SECRET, source="keeper")
    return step, {k: v.clone() for k, v in read_tensors(payload, parsed).items()}


def boundary(objects: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in flatten_state(objects)[0].items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class CopyGate:
    """Holds the background copy of one capture until the test released it, so an unfenced
    write always lands between the capture and the copy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        original = snapshotter_module.start_write

        def start_write(*args: Any, **kwargs: Any) -> None:
            if self.armed:
                self.armed = False
                self.entered.set()
                assert self.release.wait(10), "the test never released the copy"
            original(*args, **kwargs)
        monkeypatch.setattr(snapshotter_module, "start_write", start_write)


def test_a_write_before_the_copy_is_never_published_as_that_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    gate = CopyGate(monkeypatch)
    job = f"torn{secrets.token_hex(3)}"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    objects = {"model": model}
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1), checksum_workers=2)
        try:
            snap.capture(0, objects)
            snap.flush()
            at_0 = boundary(objects)
            with torch.no_grad():
                model.weight.add_(1.0)                 # step 1 ran
            at_1 = boundary(objects)
            gate.armed = True
            with caplog.at_level(logging.WARNING, logger=snapshotter_module.__name__):
                snap.capture(1, objects)
                assert gate.entered.wait(10)
                with torch.no_grad():                  # an EMA-like unfenced write
                    model.weight.mul_(0.5)
                gate.release.set()
                snap.wait_for_copy()                   # the optimizer step's fence
                snap.flush()
            step, tensors = served(keeper, job)
            assert step == 0 and same(tensors, at_0), "a torn step-1 snapshot was published"
            assert not same(tensors, at_1)
            assert snap.stats.torn == 1 and snap.stats.synchronous
            assert "event=snapshot_torn rank=0 step=1 tensors=model/weight" in caplog.text
            # from now on every capture copies before the loop goes on: later writes
            # outside the fences can no longer reach the snapshot
            snap.capture(2, objects)
            at_2 = boundary(objects)
            with torch.no_grad():
                model.weight.mul_(0.5)
            snap.flush()
            step, tensors = served(keeper, job)
            assert step == 2 and same(tensors, at_2)
            assert snap.stats.torn == 1
        finally:
            snap.close()
            client.close()


def test_a_write_in_the_middle_of_the_copy_is_never_published(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is held after its first MiB (sha256 copies and hashes a tensor leaf by
    leaf): the tensor is then half old, half new in the slot, under a valid checksum."""
    held, release, calls = threading.Event(), threading.Event(), [0]
    original = checksum_module._copy

    def copy(*args: Any) -> None:
        original(*args)
        calls[0] += 1
        if calls[0] == 1:
            held.set()
            assert release.wait(10)
    job = f"tear{secrets.token_hex(3)}"
    big = {"w": torch.zeros(1 << 19)}                  # 2 MiB of float32: two leaves
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1), checksum_algo="sha256",
                           checksum_workers=1)
        try:
            snap.capture(0, big)
            snap.flush()
            big["w"].fill_(1.0)                        # step 1 ran
            monkeypatch.setattr(checksum_module, "_copy", copy)
            snap.capture(1, big)
            assert held.wait(10)
            big["w"].fill_(2.0)                        # an unfenced write mid-copy
            release.set()
            snap.wait_for_copy()
            snap.flush()
            step, tensors = served(keeper, job)
            assert step == 0 and torch.equal(tensors["w"], torch.zeros(1 << 19)), \
                f"a torn step-{step} snapshot was published: {tensors['w'].unique()}"
        finally:
            snap.close()
            client.close()


def test_fenced_writes_and_untouched_state_publish_every_step() -> None:
    job = f"clean{secrets.token_hex(3)}"
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = {"model": model, "optimizer": optimizer}
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1))
        try:
            for step in range(1, 4):
                snap.capture(step, objects)
                at = boundary(objects)
                model(torch.randn(4, 16)).sum().backward()
                snap.wait_for_copy()                   # what the optimizer hook does
                optimizer.step()
                snap.flush()
                got_step, tensors = served(keeper, job)
                assert got_step == step and same(tensors, at)
            assert snap.stats.torn == 0 and not snap.stats.synchronous
        finally:
            snap.close()
            client.close()


def test_with_no_fence_the_publishing_thread_judges_after_a_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that never reaches a fence (no registered optimizer, no step boundary yet)
    still gets its snapshot published, or dropped when written, within VERDICT_WAIT_S."""
    monkeypatch.setattr(copy_check_module, "VERDICT_WAIT_S", 0.2)
    job = f"bound{secrets.token_hex(3)}"
    model = torch.nn.Linear(16, 8)
    objects = {"model": model}
    with Keeper("node0", job, SECRET) as keeper:
        client = KeeperClient(*keeper.address, SECRET, job)
        snap = Snapshotter(client, job=job, rank=0, generation=0, secret=SECRET,
                           policy=SnapshotPolicy(every_steps=1))
        try:
            snap.capture(0, objects)
            at_0 = boundary(objects)
            deadline = time.monotonic() + 10
            while snap.stats.captures < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert snap.stats.captures == 1
            snap.capture(1, objects)
            with torch.no_grad():
                model.weight.add_(1.0)          # no fence, no flush: the thread judges
            while snap.stats.torn < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert snap.stats.torn == 1
            step, tensors = served(keeper, job)
            assert step == 0 and same(tensors, at_0)
        finally:
            snap.close()
            client.close()


def test_copy_check_sees_in_place_ops_but_not_data_or_numpy_writes() -> None:
    """What the version counters see (docs/porting.md, 'What the loop must not do')."""
    param = torch.nn.Parameter(torch.zeros(8))
    tensors = {"p": param.detach()}          # what a module's state_dict() hands out
    for write in (lambda: param.detach().add_(1), lambda: tensors["p"][2:4].fill_(3)):
        check = CopyCheck(tensors)
        write()
        assert check.wait(0.0) == ("p",)
    with torch.no_grad():
        check = CopyCheck(tensors)
        param.mul_(2)
        assert check.wait(0.0) == ("p",)
    check = CopyCheck(tensors)
    param.data.add_(1)                       # not seen: the loop must not do this
    param.detach().numpy()[0] = 5            # not seen either
    assert check.wait(0.0) == ()


# -- the session: gradients, numpy generators, an unfenced write in a real loop ---------
def keeper_session(job: str, keeper: Keeper) -> Session:
    host, port = keeper.address
    context = WorkerContext(job=job, rank=0, world_size=1, secret_hex=SECRET.hex(),
                            torch_threads=torch.get_num_threads(), keeper_host=host,
                            keeper_port=port, snapshot_every="1")
    return Session(context, capture_rng=False)


def run_steps(session: Session, steps: int, body: Any) -> None:
    with session:
        while session.step_index < steps:
            with session.step() as step:
                body(step)


def train(zero: str, steps: int = 4) -> Session:
    """A real loop with snapshots every step; ``zero``: how gradients are handled (zeroed to
    None or to zeros at the start of each step, two micro-batches inside one step, or one
    micro-batch per step with the optimizer stepping every other step; "partial": the
    optimizer holds only the weight, the bias keeps a gradient no step consumes)."""
    job = f"grad{secrets.token_hex(3)}"
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD([model.weight] if zero == "partial" else model.parameters(),
                                lr=0.1)
    with Keeper("node0", job, SECRET) as keeper:
        session = keeper_session(job, keeper)
        session.register(model=model, optimizer=optimizer)

        def body(step: int) -> None:
            if zero != "across":
                optimizer.zero_grad(set_to_none=zero != "zeros")
            for _ in range(2 if zero == "inside" else 1):      # micro-batches
                model(torch.randn(8, 4)).pow(2).mean().backward()
            if zero != "across" or step % 2 == 1:
                optimizer.step()
            if zero == "across" and step % 2 == 1:
                optimizer.zero_grad()
        run_steps(session, steps, body)
    return session


def test_gradients_accumulated_across_steps_are_refused() -> None:
    for zero in ("none", "zeros", "inside", "partial"):        # gradients that are no state: pass
        assert train(zero).step_index == 4
    with pytest.raises(StateNotCapturable, match=r"'model\.(weight|bias)' accumulates "
                       r"gradients across session.step\(\) calls.*inside one session.step"):
        train("across")


@pytest.mark.parametrize("make", [
    lambda: np.random.default_rng(7),
    lambda: np.random.Generator(np.random.MT19937(7)),
    lambda: np.random.Generator(np.random.Philox(7)),
    lambda: np.random.RandomState(7),
])
def test_numpy_generators_round_trip_through_the_tree(make: Any) -> None:
    rng = make()
    rng.random(5)
    tensors, spec = flatten_state({"rng": rng})
    restored = unflatten_state(tensors, spec, copy=True)["rng"]
    assert type(restored) is type(rng)
    assert np.array_equal(restored.random(20), rng.random(20))


def test_a_registered_numpy_generator_is_restored_in_place() -> None:
    job = f"nprng{secrets.token_hex(3)}"
    rng = np.random.default_rng(3)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Keeper("node0", job, SECRET) as keeper:
        session = keeper_session(job, keeper)
        session.register(model=model, optimizer=optimizer, rng=rng)

        def body(_step: int) -> None:
            optimizer.zero_grad()
            x = torch.from_numpy(rng.standard_normal((8, 4)).astype(np.float32))
            model(x).pow(2).mean().backward()
            optimizer.step()
        host, port = keeper.address
        with session:
            while session.step_index < 3:
                with session.step() as step:
                    body(step)
            assert session._snapshotter is not None
            session._snapshotter.flush()
            want = rng.random(10)
            rng.random(100)                          # a step that is rolled back
            session._apply_restore(3, [KeeperCopy(NodeId("node0"), host, port)], 0)
            assert session.extras["rng"] is rng
            assert np.array_equal(rng.random(10), want)


def test_an_unfenced_write_in_the_loop_never_reaches_a_published_snapshot(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A registered EMA model (no buffers, so no forward fence) updated before the
    optimizer step: the capture whose copy that write may have raced (the first, step 0's)
    is dropped, and every later one is copied before the loop goes on, so it equals its
    step boundary (step 1's copy is held until the EMA update where captures still copy
    in the background: without the check, that snapshot is torn)."""
    gate = CopyGate(monkeypatch)
    job = f"ema{secrets.token_hex(3)}"
    torch.manual_seed(0)
    model, ema = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Keeper("node0", job, SECRET) as keeper:
        session = keeper_session(job, keeper)
        session.register(model=model, ema=ema, optimizer=optimizer)

        def body(step: int) -> None:
            states[step] = boundary(session._objects)
            optimizer.zero_grad()
            model(torch.randn(8, 8)).pow(2).mean().backward()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
            gate.release.set()              # step 1's copy runs only now
            optimizer.step()
            if step == 1:                   # step 1's snapshot is published or dropped
                assert session._snapshotter is not None
                session._snapshotter.flush()
                published.append(served(keeper, job))
                assert session._snapshot_extra()["snapshot"]["torn"] == 1   # heartbeat
            if step == 0:     # step 0's copy judged (it may still run after the fence)
                assert session._snapshotter is not None
                session._snapshotter.flush()
            stats = session.snapshot_stats
            gate.armed = step == 0 and not getattr(stats, "synchronous", False)
            gate.release.clear()            # hold step 1's copy (if in the background)
        published: list[tuple[int, dict[str, torch.Tensor]]] = []
        with caplog.at_level(logging.WARNING, logger=snapshotter_module.__name__):
            run_steps(session, 4, body)
        [(step, tensors)] = published
        assert step == 1 and same(tensors, states[1]), "a torn step-1 snapshot was published"
        step, tensors = served(keeper, job)
        assert step == 4
        final = boundary(session._objects)
        assert same({k: v for k, v in tensors.items() if not k.startswith("__")},
                    {k: v for k, v in final.items() if not k.startswith("__")})
    assert "event=snapshot_torn rank=0 step=0 tensors=ema/weight,ema/bias" in caplog.text
    assert "event=snapshot_synchronous rank=0 step=0" in caplog.text
    assert caplog.text.count("event=snapshot_torn") == 1
