"""A rank's side of cross-replica verification, driven for three ranks over a fake
all-reduce (the verified step each rank protects, the frozen step after a divergence, the
reset after a rollback, replicas that never agreed named by every rank in the job's first
generation only), and the ``corrupt_params`` drill flipping a bit in a real child process
through the memory map its session would write."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from phalanx.configs.errors import ReplicasNeverAgreed
from phalanx.launcher.drills.faults.memory import MemoryFaultFailed, corrupt_params, pick_tensor
from phalanx.launcher.drills.catalogue import FaultSpec
from phalanx.runtime.worker.drill_hooks import read_memory_maps, tensor_table
from phalanx.runtime.consistency.digest import ReplicaStatus
from phalanx.runtime.consistency.verify import ReplicaVerifier

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]
SPEC = {"version": 1, "objects": {"model": {"kind": "state_dict",
                                            "tree": {"t": "tensor", "name": "model/w"}}}}


class FakeGroup:
    """Sums what every rank started, in order: the n-th reduce of each rank are one."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.rounds: list[list[torch.Tensor]] = []
        self.started = [0] * world

    def begin(self, rank: int) -> Any:
        def start(tensor: torch.Tensor) -> int:
            index = self.started[rank]
            self.started[rank] += 1
            if index == len(self.rounds):
                self.rounds.append([])
            self.rounds[index].append(tensor.clone())
            return index
        return start

    def wait(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        assert len(self.rounds[index]) == self.world, "a rank collected before all started"
        return torch.stack(self.rounds[index]).sum(dim=0)


def run_ranks(steps: int, corrupt_from: int | None = None,
              generation: int = 0) -> tuple[list[Any], list[Any]]:
    """Per-step snapshots of 3 ranks; rank 2's model checksum differs from
    ``corrupt_from`` on. Returns (verifiers, snapshotters)."""
    group = FakeGroup(3)
    snaps = [SimpleNamespace(protect_step=None, on_published=None) for _ in range(3)]
    ranks = [ReplicaVerifier(["model"], 3, generation, snap) for snap in snaps]

    def publish(rank: int, step: int) -> None:
        bad = corrupt_from is not None and rank == 2 and step >= corrupt_from
        snaps[rank].on_published(step, {"model/w": "xxh3:" + ("bad" if bad else f"{step}")},
                                 SPEC)

    for rank, verifier in enumerate(ranks):
        verifier.note_capture(0)
        publish(rank, 0)
    for boundary in range(1, steps + 1):
        for rank, verifier in enumerate(ranks):
            verifier.collect(group.wait)
            verifier.start(boundary, group.begin(rank))
            publish(rank, boundary)
    return ranks, snaps


def test_every_rank_verifies_and_protects_the_same_steps() -> None:
    ranks, snaps = run_ranks(6)
    # at boundary 6 the comparison of step 4 (started at boundary 5) was read
    assert [r.status().verified for r in ranks] == [4, 4, 4]
    assert [s.protect_step for s in snaps] == [4, 4, 4]
    assert not any(r.diverged for r in ranks)
    assert ranks[0].status().recent[-1][0] == 6


def test_a_divergence_freezes_the_verified_step_until_a_rollback() -> None:
    ranks, snaps = run_ranks(12, corrupt_from=5)
    statuses = [r.status() for r in ranks]
    assert [s.verified for s in statuses] == [4, 4, 4]
    assert [s.protect_step for s in snaps] == [4, 4, 4]
    assert [s.diverged[0] for s in statuses if s.diverged] == [5, 5, 5]
    assert statuses[2].diverged[1] != statuses[0].diverged[1] == statuses[1].diverged[1]
    extra = {"replicas": statuses[0].to_extra()}
    assert ReplicaStatus.from_extra(extra) == statuses[0]
    for verifier in ranks:
        verifier.reset(4, generation=1)
    assert not any(r.diverged for r in ranks)
    assert [r.status().verified for r in ranks] == [4, 4, 4]
    assert all(step <= 4 for step, _ in ranks[0].status().recent)
    ranks[0].reset(2, generation=2)         # a rollback below it: nothing verified now
    assert ranks[0].status().verified == -1 and snaps[0].protect_step is None


def test_ranks_that_never_agreed_raise_on_every_rank_in_the_first_generation_only() -> None:
    """Step 0's comparison, read at boundary 2, diverges before anything agreed: in the
    job's first generation every rank raises there (they all read the same outcome); in a
    later one (replacements, whose own history starts empty) a rank only reports it."""
    group = FakeGroup(3)
    snaps = [SimpleNamespace(protect_step=None, on_published=None) for _ in range(3)]
    ranks = [ReplicaVerifier(["model"], 3, 0, snap) for snap in snaps]
    for rank, verifier in enumerate(ranks):
        verifier.note_capture(0)
        snaps[rank].on_published(0, {"model/w": f"xxh3:{rank}"}, SPEC)
        verifier.collect(group.wait)
        verifier.start(1, group.begin(rank))
    for verifier in ranks:
        with pytest.raises(ReplicasNeverAgreed, match="did not start from the same state"):
            verifier.collect(group.wait)
    later, _ = run_ranks(4, corrupt_from=0, generation=1)
    assert [r.status().diverged[0] for r in later] == [0, 0, 0]
    group = FakeGroup(3)                                # a rollback leaves the first one
    snaps = [SimpleNamespace(protect_step=None, on_published=None) for _ in range(3)]
    rolled = [ReplicaVerifier(["model"], 3, 0, snap) for snap in snaps]
    for rank, verifier in enumerate(rolled):
        verifier.reset(0, generation=1)
        verifier.note_capture(0)
        snaps[rank].on_published(0, {"model/w": f"xxh3:{rank}"}, SPEC)
        verifier.start(1, group.begin(rank))
    assert [v.collect(group.wait).state for v in rolled] == ["diverged"] * 3


def test_offers_at_agreements_verify_the_newest_capture_before_the_next_one() -> None:
    """``every_steps: auto``: captures at steps 0 and 100, interval agreements every 16
    steps between them. The capture of 100 is verified at the second agreement after it
    (the first offers it before rank 2's publish computed its digest: unknown, offered
    again), 68 steps before the next capture would have compared it."""
    group = FakeGroup(3)
    snaps = [SimpleNamespace(protect_step=None, on_published=None) for _ in range(3)]
    ranks = [ReplicaVerifier(["model"], 3, 0, snap) for snap in snaps]

    def publish(rank: int, step: int) -> None:
        snaps[rank].on_published(step, {"model/w": f"xxh3:{step}"}, SPEC)

    for rank, verifier in enumerate(ranks):
        verifier.note_capture(0)
        publish(rank, 0)
    for rank, verifier in enumerate(ranks):          # capture at 100: compares step 0
        verifier.collect(group.wait)
        verifier.start(100, group.begin(rank))
        if rank != 2:                                # rank 2's publish of 100 still runs
            publish(rank, 100)
    verified = []
    for agreement in (112, 128, 144):
        for rank, verifier in enumerate(ranks):
            verifier.collect(group.wait)
            verifier.offer(group.begin(rank))
        if agreement == 112:
            publish(2, 100)
        verified.append([r.status().verified for r in ranks])
    assert verified == [[0, 0, 0], [0, 0, 0], [100, 100, 100]]
    assert [s.protect_step for s in snaps] == [100, 100, 100]
    assert group.started == [4, 4, 4]                # the collectives lined up


def test_the_comparison_in_flight_at_the_end_is_read_only_once_every_rank_finished_it(
        ) -> None:
    """A session's close reads the comparison the last snapshot step started (its final
    member record then carries that verified step, and the job's last commit is not a
    comparison behind); a rank that closes before a peer started it does not wait."""
    group = FakeGroup(3)
    snaps = [SimpleNamespace(protect_step=None, on_published=None) for _ in range(3)]
    ranks = [ReplicaVerifier(["model"], 3, 0, snap) for snap in snaps]

    class Started:
        def __init__(self, index: int) -> None:
            self.index = index

        def is_completed(self) -> bool:
            return len(group.rounds[self.index]) == group.world

    def wait(work: Started, tensor: torch.Tensor) -> torch.Tensor:
        return group.wait(work.index, tensor)

    for rank, verifier in enumerate(ranks):
        verifier.note_capture(0)
        snaps[rank].on_published(0, {"model/w": "xxh3:0"}, SPEC)
    ranks[0].start(1, lambda t: Started(group.begin(0)(t)))
    ranks[0].collect_finished(wait)                 # ranks 1 and 2 have not started it
    assert ranks[0].status().verified == -1
    for rank in (1, 2):
        ranks[rank].start(1, lambda t, r=rank: Started(group.begin(r)(t)))
    for verifier in ranks:
        verifier.collect_finished(wait)
    assert [r.status().verified for r in ranks] == [0, 0, 0]
    assert [s.protect_step for s in snaps] == [0, 0, 0]


# --- the corrupt_params drill --------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, torch
    from phalanx.runtime.worker.drill_hooks import write_memory_map
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    write_memory_map(sys.argv[1], 0, "w0-g0", 0, {"model": model, "__rng__": object()})
    print("ready", flush=True)
    sys.stdin.readline()
    print(model.weight[0, 0].item(), model.weight[0, 1].item(), flush=True)
""")


def test_corrupt_params_flips_one_bit_in_another_process(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        env = SimpleNamespace(run_dir=tmp_path, rank_pid=lambda rank: child.pid)
        spec = FaultSpec("corrupt_params", rank=0, params={"bit": 22})
        try:
            done = corrupt_params(spec, env)
        except MemoryFaultFailed as exc:
            pytest.skip(f"no ptrace permission here: {exc}")
        assert done["tensor"] == "model/weight" and done["offset"] == 2
        assert (done["byte_before"], done["byte_after"]) == (0x80, 0xC0)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["1.5", "1.0"]   # 0x3F800000 -> 0x3FC00000
    finally:
        child.kill()
        child.wait()
    [found] = read_memory_maps(tmp_path, 0)
    assert found["pid"] == child.pid and "model/bias" in found["tensors"]


def test_the_default_tensor_is_the_first_floating_point_one() -> None:
    model = torch.nn.Linear(2, 1)
    table = tensor_table({"steps": {"n": torch.zeros(2, dtype=torch.int64)}, "model": model})
    assert pick_tensor(table, "", 0)[0] == "model/weight"
    assert table["model/weight"]["address"] == model.weight.data_ptr()
    with pytest.raises(Exception, match="not a tensor"):
        pick_tensor(table, "model/nope", 0)
