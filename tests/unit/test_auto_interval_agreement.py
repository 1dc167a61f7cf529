"""``snapshot.every_steps: auto`` across ranks: every rank must snapshot the same steps (a
tier commits a step, and a global commit counts it, only when every rank has it), although
each rank's own measurements ask for a different interval."""
from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import pytest
import torch

from phalanx.runtime.context import WorkerContext
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.worker.session import AGREE_EVERY_STEPS, Session

SECRET = secrets.token_bytes(32)
STEPS = 60


class PairReducer:
    """An in-memory all_reduce (sum) between two threads: the contract of the session's
    group, without gloo, so each rank's Session runs its real step()/snapshot code."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=20)
        self._parts: dict[int, torch.Tensor] = {}
        self.calls = [0, 0]

    def __call__(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.calls[rank] += 1
        self._parts[rank] = tensor.clone()
        self._barrier.wait()
        total = self._parts[0] + self._parts[1]
        self._barrier.wait()
        tensor.copy_(total)
        return tensor


def run_rank(rank: int, keeper: Keeper, budget: float, reducer: PairReducer,
             captured: dict[int, list[int]], errors: list[BaseException],
             agreed: dict[int, int], agreements: dict[int, list[int]]) -> None:
    host, port = keeper.address
    ctx = WorkerContext(job=keeper.job, rank=rank, world_size=2, secret_hex=SECRET.hex(),
                        torch_threads=torch.get_num_threads(), keeper_host=host,
                        keeper_port=port, snapshot_every="auto", overhead_budget=budget)
    try:
        session = Session(ctx, capture_rng=False)
        model = torch.nn.Linear(256, 256)
        session.register(model=model)
        session.all_reduce = lambda t: reducer(rank, t)         # type: ignore[method-assign]
        session._start_snapshots()
        snapshotter = session._snapshotter
        assert snapshotter is not None
        snapshotter.agree_interval(1)      # what start() does in a launched multi-rank job
        original = snapshotter.capture

        def recording(step: int, objects: Any) -> float:
            captured[rank].append(step)
            return original(step, objects)
        snapshotter.capture = recording                          # type: ignore[method-assign]
        agree = session._agree_interval

        def agreeing(snap: Any) -> None:
            agreements[rank].append(session.step_index)
            agree(snap)
        session._agree_interval = agreeing                      # type: ignore[method-assign]
        session._started = True
        while session.step_index < STEPS:
            with session.step():
                with torch.no_grad():
                    model.weight.add_(1e-3)
                time.sleep(0.002)
        snapshotter.flush()
        agreed[rank] = snapshotter.stats.interval
        session.close()
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_ranks_with_different_budgets_snapshot_the_same_steps() -> None:
    reducer = PairReducer()
    captured: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []
    agreed: dict[int, int] = {}
    agreements: dict[int, list[int]] = {0: [], 1: []}
    with Keeper("node0", f"agree{secrets.token_hex(3)}", SECRET, slots=3) as keeper:
        # rank 0 may spend 90% of its step time on snapshots, rank 1 only 5%: their own
        # intervals differ by orders of magnitude
        threads = [threading.Thread(target=run_rank, args=(r, keeper, budget, reducer,
                                                             captured, errors, agreed,
                                                             agreements))
                   for r, budget in ((0, 0.9), (1, 0.05))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    assert not errors, errors
    assert captured[0] == captured[1], captured
    # the first snapshot allocates, the second measures; until an agreement carries what
    # it measured, the interval is UNMEASURED_INTERVAL, not 1 (no third one back to back)
    assert captured[0][:2] == [0, 1], captured
    assert all(step > 2 for step in captured[0][2:]), captured
    # rank 1's larger interval won: rank 0, which alone would snapshot every step, took it
    # (on a loaded machine it can exceed the steps left, so gaps alone cannot show it)
    assert agreed[0] == agreed[1] > 1, (agreed, captured)
    # both ranks agreed at the same steps: every snapshot step after the first, every
    # AGREE_EVERY_STEPS steps, and every step from the measuring snapshot until an
    # agreement carried a measurement (a few steps: the ranks agree each step meanwhile)
    assert agreements[0] == agreements[1], agreements
    scheduled = set(captured[0][1:]) | set(range(AGREE_EVERY_STEPS, STEPS + 1, AGREE_EVERY_STEPS))
    extra = sorted(set(agreements[0]) - scheduled)
    assert extra == list(range(2, 2 + len(extra))) and len(extra) < 10, agreements
    assert scheduled <= set(agreements[0]), agreements
    assert reducer.calls[0] == reducer.calls[1] == len(agreements[0])
