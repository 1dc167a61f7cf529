"""FSDP2 on CPU under phalanx (examples/train_fsdp.py: ``fully_shard`` over a gloo
``DeviceMesh`` built on the script's default group, Adam, 2 ranks on 2 virtual nodes, a
warm spare). Its fault-free run ends with torchrun's local shards bit for bit, and the
shipped ``kill_worker`` and ``kill_node`` drills end bit-identical to it: the replacement
rank restores its DTensor shards (model and Adam state) from a keeper's snapshot and the
survivors' mesh keeps working on the re-formed default group."""
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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = run_root / "torchrun"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), str(EXAMPLE), *ARGS, "--out", str(out)],
        cwd=run_root, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = {r: Path(f"{out}.rank{r}").read_text() for r in range(2)}
    assert shards[0] != shards[1]             # sharded: each rank holds different values
    return shards


def shard_hashes(run_dir: Path) -> dict[int, str]:
    """The script's own final line per rank (its local shards), from the run's worker logs
    (a killed worker wrote none; its replacement did)."""
    found: dict[int, str] = {}
    for log in (run_dir / "logs").glob("rank_*.log"):
        for rank, digest in HASH.findall(log.read_text()):
            found[int(rank)] = digest
    return found


def fsdp_drill(name: str, run_root: Path) -> tuple[dict, subprocess.CompletedProcess]:
    result = drill("run", f"configs/drills/{name}.yaml", "--verify", "--config",
                   "configs/fsdp.yaml", "--set", f"job.argv={json.dumps(ARGS)}",
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
    report, result = fsdp_drill("kill_worker", run_root)
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
    # detection.compare_replicas is on (the default): the shards are left out of the
    # digests, which agree, so the commit point (over agreed steps only) moved on
    assert json.loads((drilled / "summary.json").read_text())["committed_step"] > 0
    assert not any("replicas_diverged" in p.read_text() for p in (drilled / "logs").iterdir())
    assert_nothing_left(footprint)


@pytest.mark.timeout(600)
def test_fsdp2_survives_kill_node_bit_identical_to_torchrun(
        run_root: Path, torchrun_shards: dict[int, str], footprint: Footprint) -> None:
    report, _ = fsdp_drill("kill_node", run_root)
    drilled = Path(report["run"]["run_dir"])
    assert shard_hashes(drilled) == torchrun_shards
    events = [json.loads(line) for line in (drilled / "events.jsonl").open()]
    (recovered,) = [e for e in events if e["event"] == "recovered"]
    assert recovered["ranks"] == [1] and recovered["fault"] == "node_died", recovered
    assert_nothing_left(footprint)
