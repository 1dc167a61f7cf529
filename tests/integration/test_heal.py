"""Healing from live peers over a real gloo group (``phalanx.runtime.worker.heal``), three
ranks as three processes: the step rule when survivors are one step apart (the race of a
rank that applied its optimizer step while another did not), the replicated state sent
bit for bit into a replacement that holds none (a fresh optimizer without state), and the
fall-back when no step can be healed at."""
from __future__ import annotations

import pytest
import torch

from phalanx.runtime.group.collective import Collective
from phalanx.runtime.snapshot.state_classes import classify
from phalanx.runtime.worker import heal
from tests.integration.two_ranks import Rank, on_ranks

pytestmark = pytest.mark.integration
STEP = 5        # survivors at STEP (optimizer not applied) or STEP + 1 (applied)


def _trained(steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same deterministic training on every rank: its replicated state after ``steps``."""
    torch.manual_seed(seed)
    # the 1024 x 1024 weight (4 MiB, and its Adam moments) is sent alone, the rest grouped
    model = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.BatchNorm1d(1024),
                                torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=data)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    params = [p.detach().numpy().tobytes() for p in model.parameters()]
    moments = [t.numpy().tobytes() for s in opt.state_dict()["state"].values()
               for t in s.values() if isinstance(t, torch.Tensor)]
    return params + moments


def _tensor_addresses(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    return [p.data_ptr() for p in model.parameters()] + [
        t.data_ptr() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _heal_rank(rank: Rank, live: list[int], per_rank_steps: list[list[int]],
               groups: list[tuple[int, ...]] | None = None) -> dict:
    """One rank: its state at ``live[rank]`` (-1: a replacement, a different init and a
    fresh optimizer; -2: a replacement whose script created its optimizer state zeroed, as
    ``examples/train_transformer.py`` does); heal; return the agreed step, whether its
    replicated state now equals the reference trained to that step, and whether it was
    received into the tensors the rank held (the same addresses). ``groups[rank]``: the
    ranks its replicated state is alike on (HSDP's replicate dimension; each group's state
    is trained from its own seed); None: every rank."""
    mine, prebuilt = max(live[rank.rank], -1), live[rank.rank] == -2
    group = groups[rank.rank] if groups else ()
    seed = min(group) if group else 0
    model, opt = _trained(mine, seed) if mine >= 0 else _trained(0, seed=99)
    if prebuilt:
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    addresses = _tensor_addresses(model, opt)
    classes = classify({"model": model, "optimizer": opt}, {"model": "replicated"})
    assert set(classes.replicated) == {"model", "optimizer"}
    # the BatchNorm statistics, the optimizer's hyperparameters
    assert set(classes.per_rank) == {"model", "optimizer"}
    collective = Collective(rank.connect, rank=rank.rank, world_size=rank.world_size,
                            timeout_s=20.0)
    collective.form(0)
    rank.keep(collective)

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        return collective.all_reduce(tensor, lambda: False)

    def broadcast(tensor: torch.Tensor, src: int) -> None:
        collective.wait(collective.start_broadcast(tensor, src), tensor, lambda: False)

    # survivors had agreed on a snapshot interval (rank 1 measured a longer one since the
    # last agreement); a replacement has none
    interval = 10 + rank.rank if mine >= 0 else 0
    agreement = heal.agree(rank=rank.rank, world=rank.world_size, live_step=mine,
                           replicated=True, reduce=reduce, interval=interval, group=group,
                           probe=lambda s: s in per_rank_steps[rank.rank])
    # the largest, on every rank
    assert agreement.interval == max(10 + r for r, s in enumerate(live) if s >= 0)
    if agreement.step is None:
        return {"step": None,
                "equal": _state_bytes(model, opt) == _state_bytes(*_trained(mine, seed))}
    done = heal.finish(agreement, rank=rank.rank, world=rank.world_size, loaded=True,
                       replicated=classes.replicated, reduce=reduce, broadcast=broadcast)
    assert done is not None
    holders, received = done
    return {"step": agreement.step, "holders": list(holders), "received": received,
            "equal": _state_bytes(model, opt) == _state_bytes(*_trained(agreement.step, seed)),
            "in_place": _tensor_addresses(model, opt)[:len(addresses)] == addresses,
            "held": len(addresses), "tensors": len(_tensor_addresses(model, opt))}


@pytest.mark.timeout(120)
def test_ranks_a_step_apart_heal_forward_when_every_rank_has_the_newer_step() -> None:
    # rank 0 applied step 5 (at 6), rank 1 did not (at 5), ranks 2 and 3 replace lost
    # ranks whose per-rank snapshots of 6 exist: everyone ends at 6 with rank 0's state
    out = on_ranks(_heal_rank, [STEP + 1, STEP, -1, -2], [[STEP, STEP + 1]] * 4, world_size=4)
    assert [o["step"] for o in out] == [STEP + 1] * 4
    assert all(o["equal"] for o in out), out
    assert out[0]["holders"] == [0] and out[0]["received"] == 0
    assert out[1]["received"] > 0 and out[2]["received"] == out[1]["received"]
    assert out[3]["received"] == out[1]["received"]
    # received where the state lives (the same tensors afterwards) when the rank holds
    # tensors of the same shapes: rank 1's state, rank 2's model, rank 3's model and zeroed
    # optimizer state; rank 2's optimizer, stateless until its first step, got fresh ones
    assert all(o["in_place"] for o in out), out
    assert out[2]["held"] < out[2]["tensors"] == out[3]["held"] == out[3]["tensors"]


@pytest.mark.timeout(120)
def test_a_rank_ahead_is_reconciled_back_when_the_lost_rank_lacks_the_newer_step() -> None:
    # the lost rank's per-rank state exists only for step 5: rank 0, which applied step
    # 5, takes step 5's replicated state from rank 1 (which did not)
    out = on_ranks(_heal_rank, [STEP + 1, STEP, -1], [[STEP, STEP + 1], [STEP], [STEP]],
                   world_size=3)
    assert [o["step"] for o in out] == [STEP] * 3
    assert all(o["equal"] for o in out), out
    assert out[1]["holders"] == [1] and out[0]["received"] > 0


@pytest.mark.timeout(120)
def test_no_heal_when_no_survivor_holds_a_step_every_rank_can_restore() -> None:
    # every survivor applied step 5 but the lost rank has only step 5's per-rank state:
    # no live replica of step 5 exists; nobody changes anything (the ladder takes over)
    out = on_ranks(_heal_rank, [STEP + 1, STEP + 1, -1], [[STEP, STEP + 1]] * 2 + [[STEP]],
                   world_size=3)
    assert [o["step"] for o in out] == [None] * 3
    assert out[0]["equal"] and out[1]["equal"]


HSDP = [(0, 2), (1, 3), (0, 2), (1, 3)]     # a 2 x 2 mesh's replicate dimension


@pytest.mark.timeout(120)
def test_each_replica_group_heals_from_its_own_survivors() -> None:
    """HSDP: ranks {0, 2} hold one half of the shards, {1, 3} the other. Rank 1 is
    replaced: it receives its group's state from rank 3 alone; ranks 0 and 2 take part in
    the broadcasts and keep their own (other) state."""
    out = on_ranks(_heal_rank, [STEP, -1, STEP, STEP], [[STEP]] * 4, HSDP, world_size=4)
    assert [o["step"] for o in out] == [STEP] * 4
    assert all(o["equal"] for o in out), out
    assert out[1]["holders"] == [0, 2, 3] and out[1]["received"] > 0
    assert [o["received"] for o in out if o is not out[1]] == [0, 0, 0]


@pytest.mark.timeout(120)
def test_no_heal_when_every_replica_of_one_group_is_lost() -> None:
    """Ranks 1 and 3, the whole group of the second half of the shards, are replaced:
    ranks 0 and 2 still hold their half live, but nobody holds the other; no heal (the
    ladder restores every rank from snapshots) and nobody changes anything."""
    out = on_ranks(_heal_rank, [STEP, -1, STEP, -1], [[STEP]] * 4, HSDP, world_size=4)
    assert [o["step"] for o in out] == [None] * 4
    assert out[0]["equal"] and out[2]["equal"]
