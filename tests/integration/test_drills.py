"""``phalanx drill`` end to end, as a user runs it: every shipped scenario passes its own
expectations against a fault-free reference (real etcd, Ray, gloo, signals); a broken
expectation fails with a clear line; a fault injected into a running job through etcd is
fired and recovered; a seeded chaos campaign of 10 faults ends bit-identical."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from phalanx.configs.loader import load_config
from phalanx.launcher.drills.chaos import chaos_scenario
from phalanx.launcher.drills.commands import REFERENCES, computation_key
from phalanx.launcher.drills.scenario import load_scenario
from tests.integration.launching import ROOT, gloo_reference, phalanx_command, wait_training
from tests.integration.test_recovery import worker_pids
from tests.plugins.leaks import Footprint, assert_nothing_left

pytestmark = pytest.mark.integration
SCENARIOS = sorted(p.stem for p in (ROOT / "configs" / "drills").glob("*.yaml"))
ENV = {**os.environ, "COLUMNS": "160"}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run root for the module: fault-free references are cached there and shared."""
    return tmp_path_factory.mktemp("drills")


def drill(*args: str, run_root: Path, timeout_s: float = 420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "drill", *args,
           "--set", f"job.run_dir={run_root}", "--set", "job.name=drill"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=ENV)


def fired_at_their_step(report: dict) -> None:
    """``at_step: N`` fired with the ranks at step N exactly, not a few steps later (every
    rank is held at N until the launcher fired it: ``runtime.worker.drill_hooks``)."""
    for fault in report["faults"]:
        if fault["trigger"].startswith("at step "):
            assert fault["step"] == int(fault["trigger"].removeprefix("at step ").split()[0]), \
                fault


def report_of(result: subprocess.CompletedProcess) -> dict:
    line = next(ln for ln in result.stderr.splitlines() if ln.startswith("report: ")
                and ln.endswith(".json"))
    json_path = Path(line.removeprefix("report: "))
    report = json.loads(json_path.read_text())
    assert (json_path.parent / "drill-report.md").is_file()
    assert (json_path.parent / "drill-report.png").read_bytes()[:4] == b"\x89PNG"
    return report


def seed_reference(run_root: Path, *overrides: str) -> None:
    """Put the fault-free final hashes of the demo job with ``overrides`` (a scenario's)
    where ``phalanx drill run --verify`` looks for its cached reference
    (``<job.run_dir>/references/<computation_key>.json``, this module's tmp only), computed
    without phalanx: the same job under torchrun (``gloo_reference``: 14-18 s where a
    fault-free ``phalanx launch`` of it takes 35-40 s on a loaded 2-core machine; its bits
    equal a fault-free phalanx run's, which the bench compares every run). The drill still
    compares its own final state against it; the drill's own fault-free run is exercised
    by the DDP scenarios, whose script torchrun does not compute here."""
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"),
                      [*overrides, f"job.run_dir={run_root}", "drills.scenario=''"])
    cache = run_root / REFERENCES / f"{computation_key(cfg)}.json"
    if cache.is_file():
        return
    reference = gloo_reference("configs/demo.yaml", *overrides,
                               run_root=run_root / f"gloo-{cache.stem}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"hashes": {str(r): h for r, h in reference.hashes.items()},
                                 "run_dir": "torchrun (tests/integration/launching.py)"}))


# The availability drills run on the torchrun-style DDP script (examples/ddp_phalanx.py:
# DDP, DataLoader over a shuffling DistributedSampler with workers, epochs, evaluation,
# a run name broadcast at set-up, each epoch's plan broadcast at its top, an evaluation
# group from new_group, and each epoch left
# after 14 of its 16 batches by ``enumerate``'s index: the spare resumes mid-epoch;
# ``DDP(static_graph=True)``: a replacement's first iteration all-reduces every bucket at
# the end of its backward pass while the survivors' go bucket by bucket) with a BatchNorm
# model whose buffers DDP broadcasts (one shared fault-free reference); the others on the
# demo. Plain DDP through a fault: tests/integration/test_default_group_job.py.
DDP_ARGV = ('["--epochs", "3", "--sleep", "0.05", "--batchnorm", "--eval-first", '
            '"--epoch-barrier", "--run-name", "--eval-group", "--max-batches", "14", '
            '"--static-graph", "--epoch-plan"]')
ON_DDP = {"kill_worker": DDP_ARGV, "kill_node": DDP_ARGV, "hang_worker": DDP_ARGV,
          "tier_fallback": DDP_ARGV}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SCENARIOS)
def test_shipped_scenario_passes(name: str, run_root: Path, footprint: Footprint) -> None:
    job = (("--config", "configs/ddp.yaml", "--set", f"job.argv={ON_DDP[name]}")
           if name in ON_DDP else ())
    if name not in ON_DDP:
        seed_reference(run_root, *load_scenario(ROOT / "configs" / "drills" / f"{name}.yaml")
                       .override_args())
    result = drill("run", f"configs/drills/{name}.yaml", "--verify", *job, run_root=run_root)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"], report["checks"]
    assert "drill PASSED" in result.stderr
    rows = {row["check"]: row for row in report["checks"]}
    assert rows["every fault fired"]["ok"]
    fired_at_their_step(report)
    if report["scenario"].get("expect", {}).get("final_state") == "identical":
        assert rows["final state"]["measured"] == "identical"
    run_dir = Path(report["run"]["run_dir"])
    deeper = DEEPER.get(name)
    if deeper is not None:       # what the scenario's expectations cannot say
        deeper(Run(run_dir, result.stderr))
    print(f"{name}: " + "; ".join(f"{f['kind']} detect {f.get('detection_s')} s, recovery "
                                  f"{f.get('recovery_s')} s" for f in report["faults"]))
    assert_nothing_left(footprint)


class Run:
    """A drilled run's directory: its events and worker logs, and the launcher's stderr."""

    def __init__(self, run_dir: Path, stderr: str) -> None:
        self.dir, self.stderr = run_dir, stderr
        self.events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]

    def named(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]

    def logs(self) -> dict[str, str]:
        return {p.stem: p.read_text() for p in (self.dir / "logs").iterdir()}


def only_survivors_restored(run: Run, replaced: set[int]) -> None:
    """Survivors kept their process from start to end (one pid per log); the replaced
    ranks ran on a promoted spare."""
    pids = worker_pids(run.dir)
    survivors = {f"rank_{r}_w{r}-g0" for r in range(4) if r not in replaced}
    assert survivors <= set(pids), sorted(pids)
    for rank in replaced:
        assert any(n.startswith(f"rank_{rank}_spare") for n in pids), sorted(pids)


def check_kill_worker(run: Run) -> None:
    (record,) = run.named("recovered")
    assert record["ranks"] == [1] and record["fault"] == "worker_died"
    assert "Rollback" not in run.named("plan")[0]["actions"], "replicas must have been enough"
    only_survivors_restored(run, {1})
    ddp_group_reformed_in_place(run, {1})


def ddp_group_reformed_in_place(run: Run, replaced: set[int]) -> None:
    """The DDP script's survivors discarded the step whose buckets failed and re-formed
    the default group, and the group their evaluation made with ``dist.new_group``, in
    their own process; the spare's set-up collectives (DDP's construction, the run name
    rank 0 broadcast) returned what the lost rank's had, and it skipped the collectives of
    its epoch's top (the survivors passed them long ago)."""
    logs = run.logs()
    (name,) = set(re.findall(r"^rank 0 run name (\S+)$", logs["rank_0_w0-g0"], re.M))
    for rank in set(range(4)) - replaced:
        log = logs[f"rank_{rank}_w{rank}-g0"]
        assert "event=rank_rejoined" in log and "event=default_group_fault" in log, rank
        assert "optimizer step refused" in log or "event=step_failed_after_fault" in log \
            or "event=collective_aborted" in log, rank
        assert re.search(r"event=group_formed generation=[1-9].* group=sub/", log), rank
    for rank in replaced:
        (spare,) = [text for name, text in logs.items() if name.startswith(f"rank_{rank}_spare")]
        assert "event=setup_collective_replayed op=broadcast" in spare
        assert f"rank {rank} run name {name}\n" in spare          # rank 0's, long since
        assert "EOFError" not in spare
        # it joined mid-epoch: the epoch's top (the script's evaluation, barrier and
        # all-reduce), which the survivors ran before the fault, answered locally, and the
        # RNG draws of its evaluation's loader undone where the restored pass resumed
        assert "event=epoch_top_collective_skipped op=barrier" in spare
        assert "event=restored_epoch_top_undone" in spare
        # the plan rank 0 sent at that epoch's top (broadcast_object_list) is what the
        # lost rank received then (answered as if alone, it failed in pickle.loads)
        assert "event=epoch_top_collective_replayed op=broadcast" in spare
        plans = dict(re.findall(r"^rank 0 epoch (\d+) plan (.+)$", logs["rank_0_w0-g0"], re.M))
        spare_plans = re.findall(rf"^rank {rank} epoch (\d+) plan (.+)$", spare, re.M)
        assert spare_plans and all(plans[e] == plan for e, plan in spare_plans), spare_plans


def check_hang_worker(run: Run) -> None:
    (record,) = run.named("recovered")
    assert record["ranks"] == [2] and record["fault"] in ("lease_lost", "stalled"), record
    only_survivors_restored(run, {2})
    ddp_group_reformed_in_place(run, {2})


def check_kill_node(run: Run) -> None:
    (record,) = run.named("recovered")
    assert record["fault"] == "node_died" and sorted(record["ranks"]) == [1, 3], record
    assert {"rank_0_w0-g0", "rank_2_w2-g0"} <= set(worker_pids(run.dir))  # node 0 kept going
    # noticed by the keeper watch (keeper and raylet ports refuse), not Ray's health checks
    assert "event=node_gone node=node1" in run.stderr, run.stderr[-3000:]


def check_tier_fallback(run: Run) -> None:
    plan = run.named("plan")[0]
    # a lost rank's only replica died too: every rank resumes from the disk checkpoint
    assert plan["restore_step"] == 20 and "RestoreFromTier" in plan["actions"], plan


def check_spare_exhausted(run: Run) -> None:
    (waiting,) = run.named("waiting_for_capacity")
    # the two deaths in one plan (2 spares needed), or one by one when Ray reported the
    # second after the launcher's settle window (the first took the one spare: 1 needed)
    assert waiting["spares_needed"] in (1, 2), waiting
    promoted = run.named("promoted")
    assert sorted(e["rank"] for e in promoted) == [1, 2]
    assert all(e["worker"].startswith("spare") for e in promoted)      # never a cold restart
    assert any(e["to"] == "degraded" for e in run.named("phase"))
    assert len(run.named("fault")) == 2                                   # not re-emitted


def check_node_partition(run: Run) -> None:
    (lost,) = [e for e in run.named("fault") if e["kind"] == "node_died"]
    assert sorted(lost["ranks"]) == [1, 3] and lost["node"] == "node1", lost
    # a healthy rank whose gloo pair with node 1 is destroyed mid-write is aborted by gloo
    # (an IoException escapes its I/O thread): a second fault, on node 0, replaced too
    others = [e for e in run.named("fault") if e["kind"] != "node_died"]
    assert all(e["kind"] == "worker_died" and e["node"] == "node0" for e in others), others
    assert run.named("recovered")
    for name, text in run.logs().items():   # a cut-off worker never rejoined after the fence
        if name in ("rank_1_w1-g0", "rank_3_w3-g0"):
            assert "event=member_rejoined" not in text, name


def check_corrupt_params(run: Run) -> None:
    (sdc,) = run.named("sdc_detected")
    assert sdc["ranks"] == [2], sdc
    (record,) = run.named("recovered")
    assert record["fault"] == "silent_corruption"
    assert any(e["source_kind"] == "peer" for e in run.named("rank_restored"))


def check_no_restart(run: Run) -> None:
    """A fault phalanx rides out: no fault, no recovery, every worker the original one."""
    assert not run.named("fault") and not run.named("recovered")
    pids = worker_pids(run.dir)
    assert sorted(pids) == [f"rank_{r}_w{r}-g0" for r in range(4)], sorted(pids)


def check_etcd_restart(run: Run) -> None:
    """etcd down and back, then node 1's keeper replaced: no recovery, and exactly node 1's
    workers moved to the new keeper."""
    check_no_restart(run)
    kinds = {e["event"] for e in run.events}
    assert {"etcd_down", "etcd_up", "etcd_unreachable", "etcd_reachable"} <= kinds, kinds
    assert [e["node"] for e in run.named("keeper_restarted")] == ["node1"]
    moved = sorted(n for n, text in run.logs().items() if "event=keeper_reconnected" in text)
    assert moved == ["rank_1_w1-g0", "rank_3_w3-g0"], moved


def check_kill_before_commit(run: Run) -> None:
    """Nothing committed: the plan starts every rank over (no abort): a spare for the
    killed rank, a fresh worker for each survivor, none restored from anything."""
    (plan,) = run.named("plan")
    assert plan["actions"][0] == "Rollback" and plan["restore_step"] == -1, plan
    assert sorted(plan["actions"][1:]) == ["PromoteSpare"] + ["RestartWorker"] * 3, plan
    assert not run.named("job_failed")
    (record,) = run.named("recovered")
    assert record["restore_step"] == -1 and record["ranks"] == [1]
    started = set(worker_pids(run.dir))
    assert {f"rank_{r}_w{r}-g1" for r in (0, 2, 3)} <= started, sorted(started)


def check_corrupted_replica(run: Run) -> None:
    """Rank 1's replica on node 0 kept the replicated tensors as references to node 0's own
    ranks' snapshots (one copy per node), and the restore read it bit-identically (the
    scenario's restore_source and final_state checks)."""
    shared = [e for e in run.named("replica_shared") if e["node"] == "node0"]
    assert {e["rank"] for e in shared} == {1, 3}, run.named("replica_shared")
    assert all(0 < e["shared_bytes"] < e["rank_bytes"] for e in shared), shared
    restored = [e["source_kind"] for e in run.named("rank_restored") if e.get("rank") == 1]
    assert restored == ["replica"], run.named("rank_restored")


DEEPER = {"kill_worker": check_kill_worker, "hang_worker": check_hang_worker,
          "corrupted_replica": check_corrupted_replica,
          "kill_before_commit": check_kill_before_commit,
          "kill_node": check_kill_node, "tier_fallback": check_tier_fallback,
          "spare_exhausted": check_spare_exhausted, "node_partition": check_node_partition,
          "corrupt_params": check_corrupt_params, "etcd_restart": check_etcd_restart,
          "straggler": check_no_restart}


@pytest.mark.timeout(600)
def test_ddp_groups_training_models_of_their_own_compare_and_recover_apart(
        run_root: Path, tmp_path: Path) -> None:
    """DDP on two dist.new_group groups (ranks 0-1 and 2-3), each training a model of its
    own, as pipeline stages or an ensemble do: replica digests are compared within each
    group (compared across all four, the groups' different models failed the job at step 2
    with ReplicasNeverAgreed), so the commit point advances; a killed rank's groups are
    steps apart, so the recovery falls back to the full snapshots, bit-identical."""
    scenario = tmp_path / "groups.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "groups", "faults": [{"kind": "kill_worker", "target": {"rank": 1},
                                      "trigger": {"at_step": 20}}],
        "expect": {"final_state": "identical", "max_recovery_s": 10}}))
    argv = ('["--epochs", "2", "--sleep", "0.05", "--ddp-groups", "2", "--max-batches", '
            '"20"]')
    result = drill("run", str(scenario), "--verify", "--config", "configs/ddp.yaml", "--set",
                   f"job.argv={argv}", run_root=run_root)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"], report["checks"]
    run = Run(Path(report["run"]["run_dir"]), result.stderr)
    logs = "".join(run.logs().values())
    assert logs.count("replica_group=[0, 1]") >= 2 and logs.count("replica_group=[2, 3]") >= 2
    assert "ReplicasNeverAgreed" not in result.stderr and "sdc_signal" not in result.stderr
    assert "replicas_diverged" not in logs
    committed = [e["step"] for e in run.named("tier_committed")]
    assert committed and max(committed) > 0, "no step's digests agreed: nothing committed"
    assert len(run.named("recovered")) == 1


@pytest.mark.timeout(600)
def test_a_rank_lost_in_the_jobs_first_step_is_redone_on_that_steps_batch(
        run_root: Path, tmp_path: Path) -> None:
    """Rank 3 raises in the job's first step (its batch already fetched, as the first
    snapshot is taken inside that step): a spare restores it from that snapshot and the
    survivors roll back to it. Both go on from the first batch of the epoch; with the
    loader's position captured after that fetch, every rank skipped it (the DDP tier
    drill's heal at step 0 in a fresh clone) and the run ended with other parameters."""
    scenario = tmp_path / "first_step.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "first_step", "faults": [{"kind": "worker_exception", "target": {"rank": 3},
                                          "trigger": {"at_step": 0}}],
        "expect": {"final_state": "identical", "max_lost_steps": 0}}))
    result = drill("run", str(scenario), "--verify", "--config", "configs/ddp.yaml", "--set",
                   f"job.argv={DDP_ARGV}", run_root=run_root)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"], report["checks"]
    fired_at_their_step(report)
    run = Run(Path(report["run"]["run_dir"]), result.stderr)
    (recovered,) = run.named("recovered")
    assert recovered["fault"] == "worker_exception" and recovered["ranks"] == [3]
    (plan,) = run.named("plan")
    assert plan["restore_step"] == 0


@pytest.mark.timeout(600)
def test_a_broken_expectation_fails_with_a_clear_line(run_root: Path, tmp_path: Path) -> None:
    """Snapshots every 10 steps, no heal from peers and a kill after step 21: the rollback
    recomputes steps, so ``max_lost_steps: 0`` cannot hold and the drill must say so and
    exit 1."""
    scenario = tmp_path / "strict.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "strict", "overrides": {"snapshot.every_steps": 10,
                                        "recovery.heal_from_peers": False},
        "faults": [{"kind": "kill_worker", "target": {"rank": 1},
                    "trigger": {"at_step": 21}}],
        "expect": {"max_lost_steps": 0, "final_state": "identical"}}))
    seed_reference(run_root, "snapshot.every_steps=10")
    result = drill("run", str(scenario), "--verify", run_root=run_root)
    assert result.returncode == 1, result.stderr[-3000:]
    report = report_of(result)
    lost = next(r for r in report["checks"] if r["check"] == "lost steps")
    assert not lost["ok"] and lost["measured"] >= 1
    assert "expected <= 0" in lost["text"] and "FAIL" in lost["text"]
    assert "drill FAILED" in result.stderr
    final = next(r for r in report["checks"] if r["check"] == "final state")
    assert final["ok"], "the recovery itself must still be exact"


@pytest.mark.timeout(600)
def test_inject_into_a_running_job_through_etcd(run_root: Path) -> None:
    job = ("job.name=inject", "job.args.steps=100", "drills.enabled=true")
    cmd = phalanx_command("configs/demo.yaml", *job, run_root=run_root)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    try:
        run_dir = wait_training(run_root, past_step=10, name="inject")
        result = subprocess.run(
            [sys.executable, "-m", "phalanx.launcher.cli", "drill", "inject", "kill_worker",
             "--job", str(run_dir), "--rank", "2"], cwd=ROOT, capture_output=True, text=True,
            timeout=60, env=ENV)
        assert result.returncode == 0, result.stderr
        assert "fired at step" in result.stderr
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    fired = [e for e in events if e["event"] == "drill_fault"]
    assert len(fired) == 1 and fired[0]["origin"] == "inject" and fired[0]["target"] == "rank 2"
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["ranks"] == [2]
    assert _hashes(out) and _hashes(out) == _reference(run_root, job)


def _reference(run_root: Path, job: tuple[str, ...]) -> list[str]:
    """The fault-free hashes of this computation: cached by the scenario drills (the same
    key), or computed now."""
    seed_reference(run_root, *job)
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), [*job, f"job.run_dir={run_root}"])
    hashes = json.loads((run_root / REFERENCES / f"{computation_key(cfg)}.json").read_text())
    return [hashes["hashes"][str(rank)] for rank in range(cfg.job.world_size)]


def _hashes(stdout: str) -> list[str]:
    return [line.split()[-1] for line in stdout.splitlines() if "final parameter hash" in line]


@pytest.mark.timeout(900)
def test_chaos_campaign_of_ten_faults_ends_bit_identical(run_root: Path) -> None:
    demo = load_config(str(ROOT / "configs" / "demo.yaml"), [f"job.run_dir={run_root}"])
    steps = chaos_scenario(demo, 10, 11, 8)["overrides"]["job.args.steps"]
    seed_reference(run_root, f"job.args.steps={steps}")
    result = drill("chaos", "--faults", "10", "--seed", "11", "--max-minutes", "8",
                   run_root=run_root, timeout_s=840)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"]
    fired = [f for f in report["faults"] if f.get("step") is not None]
    assert len(fired) == 10
    fired_at_their_step(report)
    final = next(r for r in report["checks"] if r["check"] == "final state")
    assert final["measured"] == "identical"
