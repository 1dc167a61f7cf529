"""A torchrun script, unchanged, under ``phalanx run``: PyTorch's DDP tutorial shape
(examples/ddp_torchrun.py: init_process_group, DDP, DistributedSampler with shuffle, a
DataLoader with worker processes, epochs, an evaluation all-reduce) started from a user
project that has its own package named ``configs``. It ends with the parameters it ends
with under torchrun itself, and its ranks see torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE and
GROUP_RANK."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.launching import ROOT, latest_run, startup_lost

pytestmark = pytest.mark.integration
EXAMPLE = ROOT / "examples" / "ddp_torchrun.py"
PORTED = ROOT / "examples" / "ddp_phalanx.py"
HASH = re.compile(r"^rank \d+ final parameter hash ([0-9a-f]{64})$", re.M)

WRAPPER = f'''"""The user's entry script: reads its own package `configs`, then runs the example."""
import json, os, runpy, sys
from configs.train import EPOCHS           # the user's package, not phalanx.configs
import configs
env_out = sys.argv.pop(1)
with open(f"{{env_out}}.rank{{os.environ['RANK']}}", "w") as f:
    json.dump({{k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "WORLD_SIZE")}} | {{"configs": configs.__file__}}, f)
sys.argv[1:1] = ["--epochs", str(EPOCHS)]
runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
'''


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "__init__.py").write_text("")
    (root / "configs" / "train.py").write_text("EPOCHS = 2\n")
    (root / "train.py").write_text(WRAPPER)
    return root


def final_hashes(prefix: Path, world: int) -> list[str]:
    return [Path(f"{prefix}.rank{r}").read_text() for r in range(world)]


def torchrun_hash(tmp_path: Path, argv: list[str]) -> str:
    """The final parameter hash of ``examples/ddp_phalanx.py argv`` (its Session
    standalone) under torchrun, 2 ranks: the same on both (DDP). Once per ``argv``."""
    if tuple(argv) not in _TORCHRUN_HASHES:
        _TORCHRUN_HASHES[tuple(argv)] = _torchrun_hash(tmp_path, argv)
    return _TORCHRUN_HASHES[tuple(argv)]


_TORCHRUN_HASHES: dict[tuple[str, ...], str] = {}


def _torchrun_hash(tmp_path: Path, argv: list[str]) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), str(PORTED), *argv, "--out", str(tmp_path / "torchrun")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    hashes = set(final_hashes(tmp_path / "torchrun", 2))
    assert len(hashes) == 1, hashes
    return hashes.pop()


@pytest.mark.timeout(420)
def test_an_unchanged_torchrun_script_ends_as_under_torchrun(tmp_path: Path) -> None:
    root = project(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script_args = ["--samples", "256", "--workers", "2", "--run-name", "--eval-group"]
    # under phalanx the rendezvous spelled out as tcp://MASTER_ADDR:MASTER_PORT, as scripts
    # derived from PyTorch's ImageNet example do: the launcher's store serves the group as
    # with env:// (the script's own TCP rendezvous on the launcher's port trained, then
    # hung the launched job at its end). torchrun keeps env:// (the rendezvous does not
    # change the computation; tcp:// under torchrun hung now and then at its start here)
    tcp = ["--dist-url", "tcp://{MASTER_ADDR}:{MASTER_PORT}"]
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-port", str(port), "train.py", str(tmp_path / "torchrun-env"), *script_args,
         "--out", str(tmp_path / "torchrun")],
        cwd=root, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    launched = subprocess.run(
        [sys.executable, "-m", "phalanx.launcher.cli", "run", "--nnodes", "2",
         "--nproc-per-node", "2", "--set", f"job.run_dir={tmp_path / 'runs'}",
         "--set", "snapshot.rank_size_mb=1", "--set", "job.cpus_per_worker=0.25",
         "train.py", str(tmp_path / "phalanx-env"), *script_args, *tcp,
         "--out", str(tmp_path / "phalanx")],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-5000:]
    expected = final_hashes(tmp_path / "torchrun", 4)
    assert len(set(expected)) == 1                      # DDP: every replica the same
    assert final_hashes(tmp_path / "phalanx", 4) == expected
    envs = [json.loads(Path(f"{tmp_path / 'phalanx-env'}.rank{r}").read_text()) for r in range(4)]
    # ranks go round robin over the nodes: node 0 runs ranks 0 and 2, node 1 ranks 1 and 3
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"), ("1", "0", "2"), ("0", "1", "2"), ("1", "1", "2")]
    assert all(e["WORLD_SIZE"] == "4" for e in envs)
    assert all(e["configs"] == str(root / "configs" / "__init__.py") for e in envs)
    # unprotected, and told so: no Session counted a step or snapshotted anything
    assert "no rank of job train ran a phalanx.Session" in " ".join(launched.stderr.split())
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob("*/logs/rank_*.log"))
    assert logs.count("event=init_method_replaced init_method=tcp://") == 4
    # the run name rank 0 broadcast reached every rank; the evaluation's all-reduce ran on
    # the group the script made with dist.new_group, formed on each of the 4 ranks
    assert len(re.findall(r"^rank \d run name (\S+)$", logs, re.M)) == 4
    assert len(set(re.findall(r"^rank \d run name (\S+)$", logs, re.M))) == 1
    assert logs.count("group=sub/") == 4


@pytest.mark.timeout(240)
def test_a_script_that_fails_before_training_shows_its_own_error(tmp_path: Path) -> None:
    """A script's set-up error (its arguments, an import, a port) is the job's error, with
    the rank's traceback; no recovery is planned for it (a spare would fail the same)."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nlr = float(sys.argv[2])\nif lr <= 0:\n"
                      "    raise ValueError(f'--lr must be positive, got {lr}')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.launcher.cli", "run", "--nnodes", "2", "--spares", "1",
         "--set", f"job.run_dir={tmp_path / 'runs'}", str(script), "--lr", "-1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "job failed: rank" in proc.stderr and \
        "ValueError: --lr must be positive, got -1.0" in proc.stderr, proc.stderr[-3000:]
    assert "PlanInfeasible" not in proc.stderr and "replaced" not in proc.stderr
    assert "raise ValueError(f'--lr must be positive" in proc.stderr  # its own traceback


@pytest.mark.timeout(600)
def test_the_nanogpt_loop_survives_kill_worker_with_torchruns_parameters(tmp_path: Path) -> None:
    """nanoGPT's loop shape (examples/train_nanogpt.py: RNG-drawn batches, one prefetched
    across iterations and kept in ``session.extras``, gradient accumulation by
    ``require_backward_grad_sync``, a hand-set LR, a master-only evaluation): the shipped
    ``kill_worker`` drill passes, and every rank of both of its runs ends with the
    parameters torchrun ends with."""
    from tests.integration.test_drills import drill, report_of

    script = ROOT / "examples" / "train_nanogpt.py"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = subprocess.run(      # each rank's stdout in a file of its own (--redirects)
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), "--log-dir", str(tmp_path / "torchrun"),
         "--redirects", "3", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    outputs = sorted((tmp_path / "torchrun").rglob("stdout.log"))
    found = [h for out in outputs for h in HASH.findall(out.read_text())]
    assert len(outputs) == 2 and len(found) == 2, found
    expected = set(found)
    assert len(expected) == 1, found                       # DDP: both ranks alike
    result = drill("run", "configs/drills/kill_worker.yaml", "--verify", "--config",
                   "configs/nanogpt.yaml", run_root=tmp_path / "runs", timeout_s=400)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"], report["checks"]
    runs = [p for p in (tmp_path / "runs").iterdir()
            if (p / "logs").is_dir() and not startup_lost(p)]
    assert len(runs) == 2                                   # the fault-free run and the drilled
    for run in runs:
        finals = [h for log in (run / "logs").glob("rank_*.log")
                  for h in HASH.findall(log.read_text())]
        assert len(finals) == 2 and set(finals) == expected, (run.name, finals)


@pytest.mark.timeout(600)
def test_zero_and_persistent_workers_survive_kill_node_with_torchruns_parameters(
        tmp_path: Path) -> None:
    """DDP with ``ZeroRedundancyOptimizer`` (``--zero``) and a DataLoader whose workers
    persist across epochs (``--persistent-workers``), a node lost in the second epoch; each
    step accumulates two micro-batches (the first under ``no_sync()``), runs its forward
    under CPU autocast and clips the gradients, and rank 0 saves the model with
    ``torch.save`` after each epoch, as training scripts do.
    ZeRO: each rank holds only its own partition of the optimizer state, so a lost rank's
    partition comes from its snapshot (a replica on the surviving node) while the DDP
    parameters heal from the survivor; before, the Session's snapshot called ZeRO's
    ``state_dict()`` (a collective-only consolidation) and the job failed at its first
    snapshot. Persistent workers: the replacement makes the loader's iterator from the
    first epoch's RNG state (the workers' base seed, which seeds every sample's noise)
    and resets it for the restored epoch; before, it drew the restored epoch's shuffle
    from another RNG position (a GAN script ended with other parameters). The node is
    lost in the first step of the second epoch, after the evaluation between the epochs;
    before, the survivor ran that evaluation's all-reduce once more than the replacement
    and gloo aborted, twenty recoveries in a row. Both ranks end with the parameters the
    same script (its Session standalone) ends with under torchrun."""
    argv = ["--epochs", "2", "--sleep", "0.05", "--batchnorm", "--zero", "--persistent-workers",
            "--accum", "2", "--clip", "1.0", "--autocast"]
    expected = {torchrun_hash(tmp_path, argv)}
    saved = tmp_path / "saved"
    # the shipped kill_node scenario in the first step of the second epoch (32 steps
    # each): the ranks heal at the first epoch's last step, so the survivor's loop ends
    # and its evaluation all-reduce runs once as the first epoch's tail, with the
    # replacement's; the final state is checked against torchrun's below instead of a
    # second, fault-free phalanx run
    _, logs = drilled_on_two_ranks(tmp_path, "kill_node", [*argv, "--save-dir", str(saved)],
                                   at_step=32)                       # epoch 2's first
    assert "optimizer=sharded" in logs                      # never sent from a survivor
    finals = HASH.findall(logs)
    assert len(finals) == 2 and set(finals) == expected, finals
    # rank 0's own torch.save after each epoch: the last holds the final parameters
    assert sorted(p.name for p in saved.iterdir()) == ["epoch0.pt", "epoch1.pt"]
    assert {saved_parameters_hash(saved / "epoch1.pt")} == expected


@pytest.mark.timeout(600)
def test_a_streaming_dataset_and_evaluations_within_epochs_survive_kill_worker(
        tmp_path: Path) -> None:
    """A streaming ``IterableDataset`` (``--iterable``: each rank and each of its two
    loader workers reads its own slice of a per-epoch shuffled order, a sample's noise
    drawn in the worker) has no sampler to skip in: the replacement's loader replays the
    killed rank's pass up to its position, its workers seeded as the lost rank's were.
    The model has dropout and the script evaluates after every 4 batches, between two
    steps (its test loader draws noise from the training RNG): rank 1 is killed in the
    fourth step of the second epoch (16 steps an epoch), right after such an evaluation.
    Both ranks end with the parameters the same script ends with under torchrun, with no
    step lost. (Before, the replacement went on from the RNG of the step's end, without
    the evaluation's draws: other dropout masks, other parameters.)"""
    argv = ["--epochs", "2", "--samples", "512", "--sleep", "0.05", "--iterable",
            "--dropout", "0.1", "--eval-every", "4"]
    expected = {torchrun_hash(tmp_path, argv)}
    report, logs = drilled_on_two_ranks(tmp_path, "kill_worker", argv, at_step=20)
    assert [f["recovery"]["lost_steps"] for f in report["faults"]] == [0], report["faults"]
    # the evaluation after the 20th batch (the second epoch's 4th) moved the RNG after
    # step 20's capture, and rank 1 captured again before batch 21, then was killed
    assert "20" in re.findall(r"event=per_rank_recaptured rank=1 step=(\d+)", logs)
    finals = HASH.findall(logs)
    assert len(finals) == 2 and set(finals) == expected, finals


def drilled_on_two_ranks(tmp_path: Path, shipped: str, argv: list[str], at_step: int
                         ) -> tuple[dict, str]:
    """The shipped drill scenario ``shipped`` at step ``at_step`` on
    ``examples/ddp_phalanx.py argv`` (2 ranks), passed, with no fault-free phalanx run of
    its own (the caller checks the final state against torchrun's): its report and the
    text of its ranks' logs."""
    from tests.integration.test_drills import drill, report_of

    text = (ROOT / "configs" / "drills" / f"{shipped}.yaml").read_text()
    assert "at_step: 20" in text and "final_state: identical" in text
    scenario = tmp_path / f"{shipped}.yaml"
    scenario.write_text(text.replace("final_state: identical", "")
                        .replace("at_step: 20", f"at_step: {at_step}"))
    result = drill("run", str(scenario), "--config", "configs/ddp.yaml",
                   "--set", "job.world_size=2", "--set", f"job.argv={json.dumps(argv)}",
                   run_root=tmp_path / "runs", timeout_s=400)
    assert result.returncode == 0, result.stderr[-5000:]
    report = report_of(result)
    assert report["passed"], report["checks"]
    run = Path(report["run"]["run_dir"])
    return report, "".join(log.read_text() for log in (run / "logs").glob("rank_*.log"))


def saved_parameters_hash(path: Path) -> str:
    """The sha256 of the parameters in a ``--save-dir`` checkpoint, as the script hashes
    its model's (a state_dict's entries in order, less BatchNorm's buffers)."""
    import hashlib

    import torch

    model = torch.load(path, weights_only=True)["model"]
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    return hashlib.sha256(b"".join(t.numpy().tobytes() for k, t in model.items()
                                   if not k.endswith(buffers))).hexdigest()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("epoch", [1, 2])
def test_a_rank_killed_in_the_evaluation_between_epochs_ends_with_torchruns_parameters(
        tmp_path: Path, epoch: int) -> None:
    """Rank 1 dies (SIGKILL) inside the evaluation after epoch ``epoch`` (0-based), while the
    survivor's evaluation all-reduce waits on it: the survivor's collective fails between
    two epochs, outside any step, and it notices the recovery only after its epoch body
    ended. It re-enters the restored epoch as the replacement does, so both run that
    epoch's tail (its scheduler step, its evaluation all-reduce) once more, together.
    Before, the survivor went on into the next epoch, noticed the restore in the
    tutorial's peek (``next(iter(loader))``) and the peek raised StopIteration: a worker
    exception, a second recovery and 21 s lost where the unseen CNN script met it.
    After the last epoch (``epoch`` 2) no step follows: the ranks run the evaluation again
    and return, and the launcher takes the recovery as complete (it failed the job with
    GroupNotReformed, "had returned from its entrypoint")."""
    from tests.integration.launching import launch, latest_run

    argv = ["--epochs", "3", "--samples", "512", "--batchnorm", "--sleep", "0.02",
            "--epoch-barrier"]
    expected = {torchrun_hash(tmp_path, argv)}
    marker = tmp_path / "died"
    job = [*argv, "--die-in-eval", str(epoch), "--marker", str(marker)]
    result = launch("configs/ddp.yaml", "job.entrypoint=tests/integration/jobs/die_in_eval.py",
                    "job.world_size=2", f"job.argv={json.dumps(job)}",
                    run_root=tmp_path / "runs", timeout_s=400)
    assert result.returncode == 0, result.stderr[-5000:]
    assert marker.exists()                                   # rank 1 did die in it
    run = latest_run(tmp_path / "runs")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    faults = [e["kind"] for e in events if e["event"] == "fault"]
    assert faults == ["worker_died"], faults                 # one fault, one recovery
    assert [e["lost_steps"] for e in events if e["event"] == "recovered"] == [0]
    logs = "".join(log.read_text() for log in (run / "logs").glob("rank_*.log"))
    finals = HASH.findall(logs)
    assert len(finals) == 2 and set(finals) == expected, finals
    # both re-entered the restored epoch's top: its barrier and all-reduce, which they ran
    # before the fault, answered locally on each (sent to the group, the replacement's met
    # the survivor's evaluation all-reduce)
    for log in ("rank_0_w0-g0.log", "rank_1_spare0.log"):
        text = (run / "logs" / log).read_text()
        assert "event=epoch_top_collective_skipped op=barrier" in text, log


OWN_CHECKPOINT = ROOT / "tests" / "integration" / "jobs" / "own_checkpoint.py"


@pytest.mark.timeout(360)
def test_a_script_without_a_session_restarts_every_rank_from_its_own_checkpoint(
        tmp_path: Path) -> None:
    """PyTorch's fault-tolerant torchrun tutorial shape (its own snapshot, no Session), on
    2 nodes: node 1 lost mid-run (its raylet, keeper and worker SIGKILLed) restarts every
    rank from the top of the script, as torchrun's ``--max-restarts`` does (the warm spare
    takes one rank); they go on from the script's snapshot and end with the parameters of
    a fault-free torchrun run; the restarted ranks read TORCHELASTIC_RESTART_COUNT 1 (it was
    always 0) and TORCHELASTIC_MAX_RESTARTS 20. Before, the survivor died of SIGSEGV in DDP's reducer (or,
    once that was mended, failed the job with its peer's error); a lost node was taken for
    Ray's start-up race and the whole job launched again in a new run directory; and
    restarted ranks, which report no step, failed the job 66 s later as never rejoined."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--epochs", "20", "--load-s", "0.05"]     # >= 0.8 s an epoch
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), str(OWN_CHECKPOINT), *argv,
         "--snapshot", str(tmp_path / "torchrun.pt"), "--out", str(tmp_path / "torchrun.sha")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    runs, snapshot = tmp_path / "runs", tmp_path / "phalanx.pt"
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        launched = subprocess.Popen(
            [sys.executable, "-m", "phalanx.launcher.cli", "run", "--nnodes", "2",
             "--spares", "1", "--set", f"job.run_dir={runs}", "--set",
             "job.cpus_per_worker=0.25", "--set", "drills.enabled=true", str(OWN_CHECKPOINT),
             *argv, "--snapshot", str(snapshot), "--out", str(tmp_path / "phalanx.sha")],
            cwd=tmp_path, stdout=out, stderr=err, text=True)
        try:
            # 13 epochs: over 10 s after the scripts formed their group (SESSIONLESS_AFTER_S)
            _await_snapshot(snapshot, epochs=13, launched=launched)
            injected = subprocess.run(
                [sys.executable, "-m", "phalanx.launcher.cli", "drill", "inject", "kill_node",
                 "--node", "1", "--job", str(latest_run(runs))],
                cwd=tmp_path, capture_output=True, text=True, timeout=60)
            assert injected.returncode == 0, injected.stderr[-3000:]
            launched.wait(timeout=240)
        finally:
            launched.kill()
    stdout, stderr = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert launched.returncode == 0, stderr[-5000:]
    assert "restarted every rank from the top of its script after node_died of rank(s) [1]" \
        in stdout, stdout
    assert len(list(runs.glob("own_checkpoint-*"))) == 1 and "startup_retry" not in stderr
    run = latest_run(runs)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["restarted"], recovered
    promoted = {e["rank"]: e["worker"] for e in events if e["event"] == "promoted"}
    assert sorted(promoted) == [0, 1] and "spare0" in promoted.values(), promoted
    restarted = "".join((run / "logs" / f"rank_{r}_{w}.log").read_text()
                        for r, w in promoted.items())
    found = re.findall(r"^rank \d starts at epoch (\d+) \(restart (\d+) of at most (\d+)\)$",
                       restarted, re.M)
    starts = [int(epoch) for epoch, _, _ in found]
    assert len(starts) == 2 and len(set(starts)) == 1 and starts[0] >= 13, starts
    # torchrun's restart count and limit, as the script reads them (--max-restarts's default)
    assert {(restart, most) for _, restart, most in found} == {("1", "20")}, found
    logs = "".join(p.read_text() for p in (run / "logs").glob("rank_*.log"))
    assert "Fatal Python error" not in logs and "SIGSEGV" not in logs
    assert (tmp_path / "phalanx.sha").read_text() == (tmp_path / "torchrun.sha").read_text()


def _await_snapshot(snapshot: Path, epochs: int, launched: subprocess.Popen) -> None:
    """Until the script's snapshot holds ``epochs`` epochs."""
    import torch

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and launched.poll() is None:
        if snapshot.exists() and torch.load(snapshot, weights_only=True)["epoch"] >= epochs:
            return
        time.sleep(0.1)
    raise AssertionError(f"the script saved no snapshot of {epochs} epochs "
                         f"(launcher exit code {launched.poll()})")
