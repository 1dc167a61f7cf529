"""Cross-replica verification (silent data corruption), the pure parts: replica digests,
the in-band agreement vector, the published status, the launcher's divergence signal,
its classification and the planner's rollback-and-repair, and the commit gate."""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.configs.errors import ReplicasNeverAgreed
from phalanx.launcher.coordination.commit_tracker import CommitTracker
from phalanx.launcher.coordination.replica_check import (ReplicaCheck, corruption_signal,
                                                         replica_groups)
from phalanx.recovery.base import (FaultKind, RepairFromPeer, RecoveryPlan, ReplicaMap,
                                   RestoreFromKeeper, Rollback, SpareInventory, TierInventory,
                                   WorldView)
from phalanx.recovery.detection import SilentCorruption, classify, compare_digests
from phalanx.recovery.planner import RecoveryPolicy, plan_recovery
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.commit import KeeperReport, gate
from phalanx.runtime.keeper.reporter import KEEPERS
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore
from phalanx.runtime.consistency.digest import (REPLICAS_EXTRA, Agreement, ReplicaStatus,
                                                agreement_vector, group_slot, read_agreement,
                                                replica_digest, verified_ceiling)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SPEC = {"version": 1, "objects": {
    "model": {"kind": "state_dict", "tree": {"t": "tensor", "name": "model/w"}},
    "optimizer": {"kind": "state_dict", "tree": {"t": "tensor", "name": "optimizer/m"}},
    "scheduler": {"kind": "state_dict", "tree": {"t": "dict", "items": [["last_epoch", 3]]}},
    "__rng__": {"kind": "value", "tree": {"t": "tensor", "name": "__rng__/torch"}}}}
SUMS = {"model/w": "xxh3:aa", "optimizer/m": "xxh3:bb", "__rng__/torch": "xxh3:cc"}
NAMES = ("model", "optimizer")


# --- digests ----------------------------------------------------------------------------

def test_digest_covers_replicated_objects_only() -> None:
    digest = replica_digest(SUMS, SPEC, NAMES)
    assert digest is not None and len(digest) == 15
    assert replica_digest(dict(SUMS), SPEC, list(reversed(NAMES))) == digest
    assert replica_digest({**SUMS, "__rng__/torch": "xxh3:dd"}, SPEC, NAMES) == digest
    assert replica_digest({**SUMS, "model/w": "xxh3:ab"}, SPEC, NAMES) != digest
    assert replica_digest({**SUMS, "optimizer/m": "xxh3:ba"}, SPEC, NAMES) != digest
    assert replica_digest(SUMS, SPEC, ("model",)) != digest
    assert replica_digest(SUMS, SPEC, ("sampler",)) is None    # nothing to compare


def test_a_modules_buffers_are_per_rank_state_and_never_compared() -> None:
    import torch

    from phalanx.runtime.consistency.verify import per_rank_tensors

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    names = per_rank_tensors({"model": model, "optimizer": object()}, NAMES)
    assert names == {"model/1.running_mean", "model/1.running_var",
                     "model/1.num_batches_tracked"}
    sums = {**SUMS, "model/1.running_mean": "xxh3:01"}
    digest = replica_digest(sums, SPEC, NAMES, names)
    assert replica_digest({**sums, "model/1.running_mean": "xxh3:02"}, SPEC, NAMES,
                          names) == digest                       # per-rank statistics differ
    assert replica_digest({**sums, "model/w": "xxh3:ab"}, SPEC, NAMES, names) != digest


def test_digest_covers_plain_values_of_replicated_trees() -> None:
    other = {"version": 1, "objects": {**SPEC["objects"], "model": {
        "kind": "state_dict", "tree": {"t": "dict", "items": [["w", {"t": "tensor",
                                                                      "name": "model/w"}]]}}}}
    assert replica_digest(SUMS, other, NAMES) != replica_digest(SUMS, SPEC, NAMES)


# --- the in-band agreement vector -------------------------------------------------------

def summed(vectors: list[list[int]]) -> list[int]:
    return [sum(column) for column in zip(*vectors)]


def test_agreement_reads_agreed_diverged_and_unknown() -> None:
    same = [agreement_vector(7, "0123456789abcde") for _ in range(4)]
    assert read_agreement(summed(same), 4).state == "agreed"
    assert read_agreement(summed(same), 4).step == 7
    odd = same[:3] + [agreement_vector(7, "0123456789abcdf")]
    assert read_agreement(summed(odd), 4) == read_agreement(summed(odd), 4)
    assert (read_agreement(summed(odd), 4).state, read_agreement(summed(odd), 4).step) == \
        ("diverged", 7)
    missing = same[:3] + [agreement_vector(None, None)]
    assert read_agreement(summed(missing), 4).state == "unknown"
    shifted = same[:3] + [agreement_vector(8, "0123456789abcde")]
    assert read_agreement(summed(shifted), 4).state == "unknown"
    assert read_agreement([1, 2], 4).state == "unknown"


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.integers(0, 2**40), st.integers(0, 2**60 - 1),
       st.integers(0, 2**60 - 1), st.randoms(use_true_random=False))
def test_agreement_is_exact_for_any_digests(world: int, step: int, digest: int, other: int,
                                            rng: random.Random) -> None:
    vectors = [agreement_vector(step, f"{digest:015x}") for _ in range(world)]
    assert read_agreement(summed(vectors), world).state == "agreed"
    assert read_agreement(summed(vectors), world).step == step
    vectors[rng.randrange(world)] = agreement_vector(step, f"{other:015x}")
    expected = "agreed" if other == digest else "diverged"
    assert read_agreement(summed(vectors), world).state == expected
    assert max(summed(vectors)) < 2**63                 # fits the int64 all-reduce


def test_digests_are_compared_within_each_replica_group() -> None:
    """DDP on dist.new_group groups [0, 1] and [2, 3], each training a model of its own:
    the groups' digests differ by construction, ranks within a group must agree."""
    def vector(rank: int, digest: str, step: int = 7) -> list[int]:
        return agreement_vector(step, digest, slots=4, slot=group_slot((0, 1) if rank < 2
                                                                          else (2, 3)))
    two_models = [vector(0, "a"), vector(1, "a"), vector(2, "b"), vector(3, "b")]
    assert read_agreement(summed(two_models), 4, slots=4) == Agreement("agreed", 7)
    one_corrupted = two_models[:3] + [vector(3, "c")]
    assert read_agreement(summed(one_corrupted), 4, slots=4) == Agreement("diverged", 7)
    every_rank = [agreement_vector(7, d, slots=4, slot=group_slot(())) for d in "aabb"]
    assert read_agreement(summed(every_rank), 4, slots=4).state == "diverged"
    late = two_models[:3] + [agreement_vector(None, None, slots=4, slot=2)]
    assert read_agreement(summed(late), 4, slots=4).state == "unknown"
    assert read_agreement(summed(two_models), 4, slots=1).state == "unknown"   # lengths
    with pytest.raises(ValueError, match="slot 4"):
        agreement_vector(7, "a", slots=4, slot=4)


def test_each_replica_group_votes_alone_and_repairs_from_its_own_ranks() -> None:
    groups = {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2), 3: (3, 4, 5), 4: (3, 4, 5),
              5: (3, 4, 5)}
    digests = {0: "a", 1: "a", 2: "a", 3: "b", 4: "x", 5: "b"}
    records = [member(r, ReplicaStatus(19, (), (21, digests[r], 2), groups[r]), 2)
               for r in range(6)]
    signal = corruption_signal(records, 6, now=5.0)
    assert signal is not None and signal.groups == ((0, 1, 2), (3, 4, 5))
    six = replace(world(), world_size=6, rank_workers={r: f"w{r}" for r in range(6)},
                  worker_nodes={f"w{r}": f"n{r % 2}" for r in range(6)})
    [report] = classify([signal], six, now=6.0)
    assert report.ranks == (4,)            # not ranks 3-5: a majority of all six holds "a"
    assert "majority b" in report.evidence
    replicas = ReplicaMap.of({r: {f"n{r % 2}": (19, 21)} for r in range(6)})
    result = plan_recovery([report], six, replicas, TierInventory({}), SpareInventory({}),
                           RecoveryPolicy(), 7.0)
    assert result.of_type(RepairFromPeer) == [RepairFromPeer(4, 3, "n1", 19)]
    assert replica_groups({0: (), 1: ()}) == ()
    assert replica_groups({0: (0, 1), 1: (1, 0), 2: (2,)}) == ((0, 1), (2,))


def test_the_published_status_carries_the_replica_group() -> None:
    status = ReplicaStatus(4, ((4, "d"),), None, (2, 3))
    assert ReplicaStatus.from_extra({REPLICAS_EXTRA: status.to_extra()}) == status
    assert ReplicaStatus.from_extra({REPLICAS_EXTRA: {"verified": 4}}) == ReplicaStatus(4)


# --- published status and the commit gate -----------------------------------------------

def test_status_round_trip_and_ceiling() -> None:
    status = ReplicaStatus(12, ((13, "a" * 15), (14, "b" * 15)), (14, "b" * 15, 2))
    assert ReplicaStatus.from_extra({REPLICAS_EXTRA: status.to_extra()}) == status
    assert ReplicaStatus.from_extra({}) is None
    assert ReplicaStatus.from_extra({REPLICAS_EXTRA: {"verified": "x"}}) is None
    extras = [{REPLICAS_EXTRA: ReplicaStatus(v).to_extra()} for v in (5, 7, -1)]
    assert verified_ceiling(extras) == 7
    assert verified_ceiling([{}, {"state": "running"}]) is None
    assert gate(10, None) == 10 and gate(10, 7) == 7 and gate(3, 7) == 3


def test_commit_tracker_never_passes_the_verified_step() -> None:
    store = InMemoryStore()
    launcher = InMemoryMembership(store)
    launcher.put(KEEPERS + "a", KeeperReport("a", ("h", 1), {0: (8, 9), 1: (8, 9)}).to_json())
    tracker = CommitTracker(launcher, world_size=2, factor=0, every_steps=1)
    assert tracker.poll(now=10.0) == 9                  # nobody compares: no gate
    for rank, verified in ((0, 7), (1, 6)):
        worker = InMemoryMembership(store)
        worker.join(member(rank, ReplicaStatus(verified)), ttl_s=30)
    tracker = CommitTracker(launcher, world_size=2, factor=0, every_steps=1)
    assert tracker.poll(now=10.0) == 7


# --- the launcher's signal and its classification ---------------------------------------

def member(rank: int, status: ReplicaStatus | None, generation: int = 2) -> MemberRecord:
    extra: dict[str, Any] = {} if status is None else {REPLICAS_EXTRA: status.to_extra()}
    return MemberRecord(f"w{rank}", rank, f"n{rank % 2}", generation=generation, extra=extra)


def diverged(rank: int, digest: str, step: int = 21, generation: int = 2) -> MemberRecord:
    return member(rank, ReplicaStatus(19, (), (step, digest, generation)), generation)


def test_signal_needs_every_rank_to_report_the_same_divergence() -> None:
    records = [diverged(0, "a"), diverged(1, "a"), diverged(2, "b"), diverged(3, "a")]
    signal = corruption_signal(records, 4, now=5.0)
    assert signal == SilentCorruption(21, 19, ((0, "a"), (1, "a"), (2, "b"), (3, "a")), 2, 5.0)
    assert corruption_signal(records[:3], 4, now=5.0) is None
    assert corruption_signal(records[:3] + [member(3, ReplicaStatus(19))], 4, 5.0) is None
    assert corruption_signal(records[:3] + [diverged(3, "a", step=22)], 4, 5.0) is None
    assert corruption_signal(records[:3] + [member(3, None)], 4, 5.0) is None
    stale = [diverged(r, "a", generation=2) for r in range(3)] + [
        member(3, ReplicaStatus(19, (), (21, "a", 2)), generation=3)]
    assert corruption_signal(stale, 4, 5.0) is None     # rank 3 already rolled back
    check = ReplicaCheck()
    assert check.poll(records, 4, 5.0) is not None and check.poll(records, 4, 6.0) is None


def test_a_divergence_before_any_step_agreed_is_a_named_error_not_corruption() -> None:
    never = [member(r, ReplicaStatus(-1, (), (0, f"d{r}", 0)), 0) for r in range(2)]
    with pytest.raises(ReplicasNeverAgreed, match="did not start from the same state"):
        ReplicaCheck(["model"]).poll(never, 2, now=1.0)
    check = ReplicaCheck()
    agreed = [member(r, ReplicaStatus(4), 0) for r in range(2)]
    assert check.poll(agreed, 2, now=1.0) is None
    later = [member(r, ReplicaStatus(-1, (), (9, f"d{r}", 0)), 0) for r in range(2)]
    assert check.poll(later, 2, now=2.0) is not None      # after an agreement: corruption


def world(generation: int = 2, committed: int = 25) -> WorldView:
    return WorldView(generation=generation, world_size=4,
                     rank_workers={r: f"w{r}" for r in range(4)},
                     worker_nodes={f"w{r}": f"n{r % 2}" for r in range(4)},
                     live_nodes=frozenset({"n0", "n1"}), committed_step=committed)


def test_majority_names_the_corrupted_ranks() -> None:
    assert compare_digests({0: "a", 1: "a", 2: "b", 3: "a"}) == ("a", (2,))
    assert compare_digests({0: "a", 1: "b"}) == (None, (0, 1))       # no majority
    assert compare_digests({0: "a", 1: "a", 2: "b", 3: "b"}) == (None, (0, 1, 2, 3))
    assert compare_digests({}) == (None, ())


def test_classify_reports_the_minority_and_drops_older_generations() -> None:
    signal = SilentCorruption(21, 19, ((0, "a"), (1, "a"), (2, "b"), (3, "a")), 2, 5.0)
    [report] = classify([signal, signal], world(), now=6.0)
    assert report.kind is FaultKind.SILENT_CORRUPTION and report.ranks == (2,)
    assert report.corruption is not None and report.corruption.verified_step == 19
    assert "step 21" in report.evidence and "rank 2: b" in report.evidence
    assert classify([signal], world(generation=3), now=6.0) == []


# --- planning the rollback and the repair -----------------------------------------------

def plan(signal: SilentCorruption, replicas: ReplicaMap, tiers: TierInventory | None = None,
         committed: int = 25) -> RecoveryPlan:
    reports = classify([signal], world(committed=committed), now=6.0)
    return plan_recovery(reports, world(committed=committed), replicas,
                         tiers or TierInventory({}), SpareInventory({}), RecoveryPolicy(), 7.0)


def own_copies(steps: tuple[int, ...]) -> ReplicaMap:
    return ReplicaMap.of({r: {f"n{r % 2}": steps} for r in range(4)})


def test_plan_rolls_every_rank_back_to_the_verified_step_and_repairs_from_a_peer() -> None:
    signal = SilentCorruption(21, 19, ((0, "a"), (1, "a"), (2, "b"), (3, "a")), 2, 5.0)
    result = plan(signal, own_copies((19, 24, 25)))
    assert not result.aborted and result.restore_step == 19
    assert result.rank_workers == {r: f"w{r}" for r in range(4)}      # nobody replaced
    assert result.of_type(RestoreFromKeeper) == [
        RestoreFromKeeper(r, f"n{r % 2}", 19, True) for r in range(4)]
    assert result.of_type(RepairFromPeer) == [RepairFromPeer(2, 0, "n0", 19)]
    assert "rank 2 <- rank 0" in result.reason
    assert RecoveryPlan.from_json(result.to_json()) == result


def test_the_peer_is_a_healthy_rank_whose_own_keeper_holds_the_step() -> None:
    signal = SilentCorruption(21, 19, ((0, "a"), (1, "a"), (2, "b"), (3, "a")), 2, 5.0)
    replicas = ReplicaMap.of({0: {"n0": (24,)}, 1: {"n1": (19,)}, 2: {"n0": (19,)},
                              3: {"n1": (19,)}})
    assert plan(signal, replicas, TierInventory({"disk": (10,)})).of_type(RepairFromPeer) \
        == []     # rank 0 lacks step 19: every rank falls back to the tier, nothing to repair
    replicas = ReplicaMap.of({0: {"n0": (24,), "n1": (19,)}, 1: {"n1": (19,)},
                              2: {"n0": (19,)}, 3: {"n1": (19,)}})
    result = plan(signal, replicas)     # rank 0 restores from its replica on n1
    assert result.restore_step == 19 and not result.of_type(Rollback)
    assert result.of_type(RepairFromPeer) == [RepairFromPeer(2, 1, "n1", 19)]


def test_no_majority_rolls_back_without_repair() -> None:
    signal = SilentCorruption(21, 19, ((0, "a"), (1, "a"), (2, "b"), (3, "b")), 2, 5.0)
    result = plan(signal, own_copies((19, 25)))
    assert result.restore_step == 19 and result.of_type(RepairFromPeer) == []


def test_verified_step_gone_from_memory_falls_back_to_an_older_tier_step() -> None:
    signal = SilentCorruption(21, 19, ((0, "a"), (1, "a"), (2, "b"), (3, "a")), 2, 5.0)
    result = plan(signal, own_copies((24, 25)), TierInventory({"disk": (10, 20)}))
    assert result.restore_step == 10 and result.of_type(Rollback)
    assert result.of_type(RepairFromPeer) == []


def test_corruption_before_any_verified_step_cannot_be_rolled_back() -> None:
    signal = SilentCorruption(1, -1, ((0, "a"), (1, "a"), (2, "b"), (3, "a")), 2, 5.0)
    result = plan(signal, own_copies((1, 2)))
    assert result.restore_step == -1 and result.of_type(Rollback)


# --- config ----------------------------------------------------------------------------

def test_config_keys_and_their_checks() -> None:
    from phalanx.configs.errors import ConfigError
    from phalanx.configs.loader import load_config_text

    base = "job:\n  entrypoint: examples/train_mlp.py:main\n"
    cfg = load_config_text(base)
    assert cfg.detection.compare_replicas and cfg.detection.replicated_state == ["model",
                                                                                 "optimizer"]
    with pytest.raises(ConfigError, match="snapshot.slots is 2"):
        load_config_text(base + "snapshot:\n  slots: 2\n")
    assert not load_config_text(base + "snapshot:\n  slots: 2\ndetection:\n"
                                "  compare_replicas: false\n").detection.compare_replicas
    with pytest.raises(ConfigError, match="replicated_state"):
        load_config_text(base + "detection:\n  replicated_state: [model, __rng__]\n")
