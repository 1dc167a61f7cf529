"""FSDP2 on CPU under phalanx (examples/train_fsdp.py: ``fully_shard`` over a gloo
``DeviceMesh`` built on the script's default group, Adam, 2 ranks on 2 virtual nodes, a
warm spare). Its fault-free run ends with torchrun's local shards bit for bit, and the
shipped ``kill_worker`` drill and a run with two faults (a hung rank, then a lost node) end
bit-identical to it: the replacement rank restores its DTensor shards (model and Adam
state) from a keeper's snapshot and the survivors' mesh keeps working on the re-formed
default group. With every in-memory copy lost (``tier_fallback``, world 3) the ranks
restore their shards from the disk tier."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

from tests.integration.launching import ROOT
from tests.integration.test_default_group import formed
from tests.integration.test_drills import drill, fired_at_their_step, report_of
from tests.integration.two_ranks import Rank, on_ranks
from tests.plugins.leaks import Footprint, assert_nothing_left

pytestmark = pytest.mark.integration
EXAMPLE = ROOT / "examples" / "train_fsdp.py"
ARGS = ["--steps", "40", "--sleep", "0.05"]
HASH = re.compile(r"^rank (\d+) final parameter hash ([0-9a-f]{64})$", re.M)


def _single_collectives(rank: Rank) -> list[list[list[float]]]:
    collective, group = formed(rank)
    seen = []
    for generation in (0, 1):
        if generation:                  # a recovery: abandon, re-form generation 1
            collective.abandon()
            collective.form(generation)
        gathered = torch.zeros(4)
        group.all_gather_single(gathered, torch.full((2,), float(rank.rank)),
                                AllgatherOptions()).wait()
        reduced = torch.zeros(2)
        group.reduce_scatter_single(reduced, torch.arange(4.0) * (rank.rank + 1),
                                    ReduceScatterOptions()).wait()
        seen.append([gathered.tolist(), reduced.tolist()])
    return seen


@pytest.mark.timeout(90)
def test_fsdp2_collectives_run_through_the_default_group_in_each_generation() -> None:
    """FSDP2's all-gather and reduce-scatter (torch 2.13's ``*_single`` ProcessGroup calls;
    gloo's reduce-scatter Work has no future) on the re-formed default group."""
    seen = on_ranks(_single_collectives)
    assert seen[0] == [[[0.0, 0.0, 1.0, 1.0], [0.0, 3.0]]] * 2
    assert seen[1] == [[[0.0, 0.0, 1.0, 1.0], [6.0, 9.0]]] * 2


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run root: the fault-free reference is computed by the first drill, cached there."""
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def torchrun_shards(run_root: Path) -> dict[int, str]:
    """Each rank's final local-shard hash under torchrun (no phalanx: its Session is
    standalone and snapshots nothing)."""
    shards = shards_under_torchrun(run_root, ARGS, 2)
    assert shards[0] != shards[1]             # sharded: each rank holds different values
    return shards


def shards_under_torchrun(root: Path, argv: list[str], world: int) -> dict[int, str]:
    """Each rank's final local-shard hash of ``examples/train_fsdp.py argv`` under
    torchrun, ``world`` ranks, run in ``root``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = root / "torchrun"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
         "--master-port", str(port), str(EXAMPLE), *argv, "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: Path(f"{out}.rank{r}").read_text() for r in range(world)}


def shard_hashes(run_dir: Path) -> dict[int, str]:
    """The script's own final line per rank (its local shards), from the run's worker logs
    (a killed worker wrote none; its replacement did)."""
    found: dict[int, str] = {}
    for log in (run_dir / "logs").glob("rank_*.log"):
        for rank, digest in HASH.findall(log.read_text()):
            found[int(rank)] = digest
    return found


def fsdp_drill(name: str, run_root: Path, *sets: str, argv: list[str] = ARGS
               ) -> tuple[dict, subprocess.CompletedProcess]:
    """A shipped drill by name, or a scenario file's path; ``sets``: more overrides."""
    scenario = name if name.endswith(".yaml") else f"configs/drills/{name}.yaml"
    more = [arg for item in sets for arg in ("--set", item)]
    result = drill("run", scenario, "--verify", "--config",
                   "configs/fsdp.yaml", "--set", f"job.argv={json.dumps(argv)}", *more,
                   run_root=run_root, timeout_s=400)
    assert "job outcome" in result.stderr, result.stderr[-5000:]
    report = report_of(result)
    rows = {row["check"]: row for row in report["checks"]}
    assert rows["every fault fired"]["ok"] and rows["job outcome"]["ok"], report["checks"]
    # the drilled run's registered state (every DTensor shard of the model and of Adam's
    # state, on every rank) equals the fault-free run's, bit for bit
    assert rows["final state"]["measured"] == "identical", report["checks"]
    fired_at_their_step(report)
    return report, result


@pytest.mark.timeout(600)
def test_fsdp2_survives_kill_worker_bit_identical_to_torchrun(
        run_root: Path, torchrun_shards: dict[int, str], footprint: Footprint) -> None:
    """The script makes no group of its own (``--mesh-only``): ``init_device_mesh`` makes
    the default group, as the DTensor and tensor-parallel tutorials' scripts do. Before,
    that call reached torch's own ``init_process_group`` (``device_mesh`` holds a binding
    of its own), the survivor's all-gather raised ``Connection reset by peer`` at the kill
    and every rank restarted from the snapshots (a second recovery, 5.5 s). Now the
    survivor keeps its process, the spare restores only rank 1, and no step is lost
    (``configs/fsdp.yaml`` snapshots the shards every step: the shipped drill passes)."""
    report, result = fsdp_drill("kill_worker", run_root, argv=[*ARGS, "--mesh-only"])
    assert report["passed"], report["checks"]
    assert "fault-free reference run" in result.stderr     # computed here, then cached
    (cache,) = (run_root / "references").glob("*.json")
    reference_run = Path(json.loads(cache.read_text())["run_dir"])
    assert shard_hashes(reference_run) == torchrun_shards          # fault-free == torchrun
    drilled = Path(report["run"]["run_dir"])
    assert shard_hashes(drilled) == torchrun_shards
    events = [json.loads(line) for line in (drilled / "events.jsonl").open()]
    (recovered,) = [e for e in events if e["event"] == "recovered"]
    assert recovered["ranks"] == [1] and recovered["fault"] == "worker_died", recovered
    spare_logs = [p.read_text() for p in (drilled / "logs").glob("rank_1_spare*.log")]
    assert len(spare_logs) == 1 and "event=restore_source rank=1" in spare_logs[0]
    # the survivor trained on in the process it started in
    assert [p.name for p in (drilled / "logs").glob("rank_0_*.log")] == ["rank_0_w0-g0.log"]
    # detection.compare_replicas is on (the default): the shards are left out of the
    # digests, which agree, so the commit point (over agreed steps only) moved on
    assert json.loads((drilled / "summary.json").read_text())["committed_step"] > 0
    assert not any("replicas_diverged" in p.read_text() for p in (drilled / "logs").iterdir())
    assert_nothing_left(footprint)


# Two faults in one run: rank 0 hangs (SIGSTOP; its peer waits inside FSDP's all-gather),
# is found by its silent member record and replaced by a warm spare; later node1 is lost
# with rank 1 (and rank 0's replacement when the spare ran there), and spares take them
# from their replicas on node0.
HANG_THEN_NODE = """\
name: fsdp_hang_then_kill_node
description: rank 0 hangs at step 10, node1 is lost at step 25
overrides:
  spares.count: 2
faults:
  - kind: hang_worker
    target: {rank: 0}
    trigger: {at_step: 10}
  - kind: kill_node
    target: {node: 1}
    trigger: {at_step: 25}
expect:
  recoveries: 2
  max_recovery_s: 12
  final_state: identical
"""


@pytest.mark.timeout(600)
def test_fsdp2_survives_a_hang_then_kill_node_bit_identical_to_torchrun(
        run_root: Path, torchrun_shards: dict[int, str], footprint: Footprint) -> None:
    scenario = run_root / "hang_then_kill_node.yaml"
    scenario.write_text(HANG_THEN_NODE)
    report, _ = fsdp_drill(str(scenario), run_root)
    drilled = Path(report["run"]["run_dir"])
    assert shard_hashes(drilled) == torchrun_shards
    events = [json.loads(line) for line in (drilled / "events.jsonl").open()]
    recovered = [(e["ranks"], e["fault"]) for e in events if e["event"] == "recovered"]
    # node1 held rank 1 and, where the pool had warmed it, rank 0's replacement too
    assert len(recovered) == 2 and recovered[1][1] == "node_died", recovered
    assert 1 in recovered[1][0], recovered
    assert recovered[0][0] == [0] and recovered[0][1] in ("stalled", "lease_lost"), recovered
    assert_nothing_left(footprint)


@pytest.mark.timeout(600)
def test_fsdp2_falls_back_to_the_disk_tier_when_every_copy_is_lost_bit_identical(
        run_root: Path, footprint: Footprint) -> None:
    """The shipped ``tier_fallback`` drill on FSDP2 at world 3 (3 nodes): nodes 0 and 1 die
    together, a rank's only replica died with its own copy, so every rank restores its
    DTensor shards from the disk tier's committed step 20 (the survivor in place, the lost
    ranks restarted on node 2) and the run ends bit-identical to its fault-free run."""
    report, _ = fsdp_drill("tier_fallback", run_root, "job.world_size=3")
    drilled = Path(report["run"]["run_dir"])
    events = [json.loads(line) for line in (drilled / "events.jsonl").open()]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert [(e["restore_step"], e["fault"]) for e in recovered] == [(20, "node_died")], recovered
    restored = {e["rank"]: e["source"] for e in events if e["event"] == "rank_restored"}
    assert sorted(restored) == [0, 1, 2] and set(restored.values()) == {"tier disk"}, restored
    assert_nothing_left(footprint)


@pytest.mark.timeout(600)
def test_hsdp_on_a_2d_mesh_survives_kill_worker_with_torchruns_shards(
        tmp_path: Path, footprint: Footprint) -> None:
    """HSDP (``--replicate 2``: a 2 x 2 DeviceMesh, parameters sharded over 2 ranks and
    replicated over 2 such pairs), world 4 on 2 nodes, rank 1 killed. The mesh's
    dimensions are groups made by ``new_group``: before, the replacement's ``new_group``
    waited for the survivors' long-made groups and the job failed (gloo
    ``connectFullMesh``); now each is formed again in the recovery's generation. The lost
    rank's shards (model and Adam state) are replicated on rank 3 (the same coordinate
    along the shard dimension): the replacement receives them from rank 3's live memory
    at the survivors' step, nobody rolls back (the shipped drill's ``max_lost_steps: 1``),
    and every rank ends with torchrun's local shards."""
    argv = ["--steps", "30", "--sleep", "0.05", "--replicate", "2"]
    expected = shards_under_torchrun(tmp_path, argv, 4)
    # replicated across the pairs {0, 2} and {1, 3}, sharded within them
    assert expected[0] == expected[2] != expected[1] == expected[3]
    # no fault-free run: torchrun's is the reference
    scenario = tmp_path / "kill_worker.yaml"
    shipped = (ROOT / "configs" / "drills" / "kill_worker.yaml").read_text()
    assert "final_state: identical" in shipped and "max_lost_steps: 1" in shipped
    scenario.write_text(shipped.replace("final_state: identical", ""))
    result = drill("run", str(scenario), "--config", "configs/fsdp.yaml",
                   "--set", "job.world_size=4", "--set", f"job.argv={json.dumps(argv)}",
                   run_root=tmp_path / "runs", timeout_s=400)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"], report["checks"]
    drilled = Path(report["run"]["run_dir"])
    assert shard_hashes(drilled) == expected
    logs = {p.name: p.read_text() for p in (drilled / "logs").glob("rank_*.log")}
    everything = "".join(logs.values())
    assert "Gloo connectFullMesh failed" not in everything
    assert re.search(r"event=group_formed generation=1 .* group=sub/", everything)
    # each pair's shards are replicated state over the pair
    assert re.search(r"event=state_classes .*model=replicated optimizer=split "
                     r"replica_group=\[1, 3\]", everything)
    (spare,) = [text for name, text in logs.items() if name.startswith("rank_1_spare")]
    healed = re.search(r"event=healed rank=1 generation=1 step=(\d+) .*holders=\[0, 2, 3\] "
                       r"received_bytes=(\d+)", spare)
    assert healed and int(healed.group(2)) > 0, spare[-3000:]
    assert "event=heal_fallback" not in everything
    assert_nothing_left(footprint)
