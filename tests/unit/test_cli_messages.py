"""The CLI never misleads: one test per known case (rich markup eating ``[a, b]``, the
``PHALANX_SET`` separator, a missing entrypoint function found only after the services
started, ``drill run`` outside a clone, ``drill list`` at 80 columns, unknown drill kinds,
``ckpt ls`` of a run's saved config, the removed ``recovery.can_shrink``, the CPU budget),
and the cases a sweep of every subcommand's error paths found. Each runs
``phalanx.launcher.cli.main`` in-process (nothing is launched) or the function behind it."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from phalanx.configs.errors import ConfigError, WorkerFailed
from phalanx.configs.loader import load_config
from phalanx.configs.schema import RecoveryConfig
from phalanx.launcher import cli
from phalanx.launcher.drills.catalogue import catalogue
from phalanx.launcher.drills.scenario import load_scenario
from phalanx.launcher.preflight import CPU_OVERCOMMIT, check_cpu_budget
from phalanx.launcher.rundir import RunDir
from phalanx.runtime.snapshot.format import checksums, make_manifest, plan_layout, write_into
from phalanx.runtime.snapshot.state_tree import flatten_state
from phalanx.runtime.tiers.disk import DiskTier
from tests.plugins.leaks import Footprint

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]


RunCli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
            tmp_path: Path) -> Iterator[RunCli]:
    """``run_cli(*argv, columns=2000) -> (exit code, stderr, stdout)``, run in ``tmp_path``
    (wide enough that rich never wraps a message)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PHALANX_SET", raising=False)

    def run(*argv: str, columns: int = 2000) -> tuple[int, str, str]:
        monkeypatch.setenv("COLUMNS", str(columns))
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.err, out.out
    yield run


def write_config(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- (1) rich markup

def test_the_set_hint_shows_flow_lists_literally(run_cli: RunCli, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", "job:\n  entrypoint: train.py:main\n")
    code, err, _ = run_cli("launch", cfg, "--set", "job.args=[a, ")
    assert code == 2 and "quote the value or write a flow list such as [a, b]" in err, err
    code, err, _ = run_cli("launch", cfg, "--set", "nonsense")
    assert code == 2 and "etcd.endpoints=[host:2379]" in err, err


def test_a_worker_error_with_brackets_is_printed_whole(run_cli: RunCli,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    message = "RuntimeError: [enforce fail at pair.cc:534] [a, b] peer [red]closed[/red]"

    def failing(args: object, console: object) -> int:
        raise WorkerFailed(1, message, "Traceback: [x]\n")
    monkeypatch.setattr(cli, "_launch", failing)
    code, err, _ = run_cli("launch", "job.yaml")
    assert code == 1 and f"job failed: rank 1: {message}" in err and "Traceback: [x]" in err


# ------------------------------------------------------------- (2) PHALANX_SET

@pytest.mark.parametrize("value", ["spares.count=0,job.world_size=4",
                                   "spares.count=0 job.world_size=4", "spares.count"])
def test_a_malformed_phalanx_set_names_the_separator(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["job.entrypoint=t.py:main"], env={"PHALANX_SET": value})
    error = caught.value
    assert error.source == "PHALANX_SET" and error.key == "spares.count"
    assert "separated by ';'" in error.hint
    assert "PHALANX_SET='spares.count=0;job.world_size=4'" in error.hint
    if "=" in value:
        assert "holds a second assignment (job.world_size=...)" in error.problem
    ok = load_config(None, ["job.entrypoint=t.py:main"],
                     env={"PHALANX_SET": "spares.count=0;job.world_size=4"})
    assert (ok.spares.count, ok.job.world_size) == (0, 4)


# ---------------------------------------------------- (3) the entrypoint function

def test_a_missing_entrypoint_function_is_refused_before_any_service(run_cli: RunCli,
                                                                     tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import os\n\ndef main_loop(steps):\n    pass\n\n"
                                       "def helper():\n    pass\n")
    cfg = write_config(tmp_path / "job.yaml", "job:\n  entrypoint: train.py:main\n"
                       f"  run_dir: {tmp_path / 'runs'}\n")
    before = Footprint.take()
    started = time.monotonic()
    code, err, _ = run_cli("launch", cfg)
    seconds = time.monotonic() - started
    assert code == 2, err
    assert seconds < 1.0, f"refused after {seconds:.2f} s: services must not start first"
    assert f"job.yaml: job.entrypoint: '{tmp_path / 'train.py'}' has no top-level function " \
           "'main'" in err, err
    assert "did you mean 'main_loop'?" in err and "defines helper, main_loop" in err
    assert "write job.entrypoint as 'train.py:NAME'" in err
    assert Footprint.take().new_since(before) == {}        # no etcd, no raylet
    assert not (tmp_path / "runs").exists()                 # not even a run directory


# ----------------------------------------------------- (4) drill run outside a clone

def test_drill_run_outside_a_clone_says_no_config_was_given(run_cli: RunCli,
                                                            tmp_path: Path) -> None:
    code, err, _ = run_cli("drill", "run", str(ROOT / "configs/drills/kill_worker.yaml"))
    assert code == 2, err
    assert "phalanx drill run: --config: not given, and the default configs/demo.yaml (a " \
           f"file of a phalanx source checkout) is not in {tmp_path}" in err, err
    assert "--config path/to/job.yaml" in err and "does not exist" not in err


# ------------------------------------------------------------- (5) drill list

def test_drill_list_shows_whole_kind_names_and_what_phalanx_does(run_cli: RunCli) -> None:
    code, err, _ = run_cli("drill", "list", columns=80)
    assert code == 0 and "…" not in err
    shown = re.findall(r"^  (\w+)  \(target: ", err, re.M)
    assert sorted(shown) == sorted(catalogue()), err
    for kind, mech in catalogue().items():
        assert mech.response and mech.response.strip() not in ("none", "replace",
                                                                "rollback"), kind
    assert "a new keeper starts on that node" in " ".join(err.split())
    assert max(len(line) for line in err.splitlines()) <= 80


# ---------------------------------------------------------- (6) unknown drill kind

def test_an_unknown_drill_kind_names_file_line_and_the_closest_kind(run_cli: RunCli,
                                                                    tmp_path: Path) -> None:
    drill = tmp_path / "drill.yaml"
    drill.write_text("name: t\nfaults:\n  - kind: kill_worker\n    target: {rank: 1}\n"
                     "    trigger: {at_step: 5}\n  - kind: kil_keeper\n    target: {node: 1}\n"
                     "    trigger: {at_step: 9}\n")
    with pytest.raises(ConfigError) as caught:
        load_scenario(drill)
    assert caught.value.line == 6
    assert str(caught.value).startswith(f"{drill}:6: faults[1].kind: 'kil_keeper' is not a "
                                        "known fault (did you mean 'kill_keeper'?)")
    cfg = write_config(tmp_path / "job.yaml", "job:\n  entrypoint: train.py:main\n")
    code, err, _ = run_cli("drill", "run", str(drill), "--config", cfg)
    assert code == 2 and f"{drill}:6:" in err and "did you mean 'kill_keeper'?" in err


# ------------------------------------------------- (7) ckpt ls of a run's config

def _checkpoint(run: RunDir, job: str, step: int) -> None:
    """A committed one-rank step in the run's own disk tier (``<run>/checkpoints``)."""
    tensors, spec = flatten_state({"w": torch.full((4,), float(step))})
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job=job, rank=0, step=step,
                             generation=0, tree_spec=spec, created_at=time.time())
    tier = DiskTier(run.path / "checkpoints", job)
    tier.write_rank(step, 0, buf, manifest.to_json())
    tier.commit_step(step, [0])


def test_ckpt_ls_of_a_runs_config_lists_that_runs_own_checkpoints(run_cli: RunCli,
                                                                  tmp_path: Path) -> None:
    cfg = load_config(None, ["job.entrypoint=t.py:main", "job.name=two",
                             f"job.run_dir={tmp_path / 'runs'}"], env={})
    first, second = RunDir.create(cfg), RunDir.create(cfg)      # `latest` is the second
    for run, step in ((first, 5), (second, 9)):
        run.write_job({"job": "two"})
        _checkpoint(run, "two", step)
    saved = load_config(first.path / "config.yaml", env={})
    assert saved.tiers.disk.path == str(first.path / "checkpoints")
    code, err, out = run_cli("ckpt", "ls", "--config", str(first.path / "config.yaml"), "--json")
    assert code == 0, err
    assert [s["step"] for s in json.loads(out)["steps"]] == [5]
    third = RunDir.create(cfg)                 # a run that has persisted nothing yet
    third.write_job({"job": "two"})
    code, err, _ = run_cli("ckpt", "ls", "--config", str(third.path / "config.yaml"))
    assert code == 2 and str(third.path / "checkpoints") in err
    assert "no step was persisted there yet" in err, err
    # a run saved by an older phalanx: an empty disk path and the retired can_shrink key
    old = (first.path / "config.yaml").read_text().replace(
        f"path: {first.path / 'checkpoints'}", "path: ''").replace(
        "recovery:\n", "recovery:\n  can_shrink: false\n")
    (first.path / "config.yaml").write_text(old)
    code, err, out = run_cli("ckpt", "ls", "--config", str(first.path / "config.yaml"), "--json")
    assert code == 0, err
    assert [s["step"] for s in json.loads(out)["steps"]] == [5]


# ---------------------------------------------------------- (8) can_shrink is gone

def test_recovery_can_shrink_is_an_unknown_key(tmp_path: Path) -> None:
    path = write_config(tmp_path / "job.yaml", "job:\n  entrypoint: t.py:main\nrecovery:\n"
                        "  can_shrink: true\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    assert (caught.value.key, caught.value.line) == ("recovery.can_shrink", 4)
    assert "unknown key" in caught.value.problem
    assert "can_shrink" not in RecoveryConfig.__dataclass_fields__
    for doc in (ROOT / "docs").glob("*.md"):
        assert "can_shrink" not in doc.read_text(encoding="utf-8"), doc


# --------------------------------------------------------------- (9) CPU budget

def test_cpus_per_node_far_above_the_machine_is_refused(run_cli: RunCli, tmp_path: Path) -> None:
    cfg = load_config(None, ["job.entrypoint=t.py:main", "ray.cpus_per_node=64"], env={})
    with pytest.raises(ConfigError) as caught:
        check_cpu_budget(cfg, cores=2)
    error = caught.value
    assert error.key == "ray.cpus_per_node"
    assert error.problem.startswith(f"64 logical CPUs per virtual node is more than "
                                    f"{CPU_OVERCOMMIT} x the 2 CPU cores of this machine (16)")
    assert "lower ray.cpus_per_node" in error.hint and "ray.address" in error.hint
    check_cpu_budget(load_config(None, ["job.entrypoint=t.py:main", "ray.cpus_per_node=64",
                                        "ray.address=10.0.0.1:6379"], env={}), cores=2)
    config = write_config(tmp_path / "job.yaml", "job:\n  entrypoint: train.py:main\n")
    code, err, _ = run_cli("launch", config, "--set", "ray.cpus_per_node=100000")
    assert code == 2 and "--set: ray.cpus_per_node: 100000 logical CPUs" in err, err


def test_the_shipped_configs_fit_the_cpu_budget_of_a_two_core_machine() -> None:
    from bench.recovery import CPUS_PER_NODE
    from bench.vs_torchrun import cpus_per_node

    demo = str(ROOT / "configs/demo.yaml")
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        check_cpu_budget(load_config(path, env={}), cores=2)
    for drill in sorted((ROOT / "configs/drills").glob("*.yaml")):
        check_cpu_budget(load_config(demo, load_scenario(drill).override_args(), env={}),
                         cores=2)
    for per_node in [CPUS_PER_NODE] + [cpus_per_node(world) for world in (1, 2, 4, 8, 16)]:
        check_cpu_budget(load_config(demo, [f"ray.cpus_per_node={per_node}"], env={}), cores=2)


# -------------------------------------------------------------- found by the sweep

def test_status_of_a_missing_run_dir_says_it_does_not_exist(run_cli: RunCli,
                                                            tmp_path: Path) -> None:
    code, err, _ = run_cli("status", str(tmp_path / "gone"))
    assert code == 2 and f"phalanx status: run_dir: '{tmp_path / 'gone'}' does not exist" in err
    code, err, _ = run_cli("status")
    assert code == 2 and f"no run found under '.phalanx/runs' (in {tmp_path})" in err, err


def test_drill_inject_into_a_job_without_drills_says_how_to_enable_them(run_cli: RunCli,
                                                                        tmp_path: Path) -> None:
    cfg = load_config(None, ["job.entrypoint=t.py:main", f"job.run_dir={tmp_path / 'runs'}"],
                      env={})
    run = RunDir.create(cfg)
    run.write_job({"job": cfg.job.name, "etcd_endpoints": ["127.0.0.1:1"],
                   "etcd_prefix": "/phalanx"})
    code, err, _ = run_cli("drill", "inject", "kill_worker", "--job", str(run.path),
                           "--rank", "1")
    assert code == 2, err
    assert "drills.enabled: is false" in err and "launched without drills" in err
    assert "--set drills.enabled=true" in err


def test_ckpt_without_a_run_names_the_folder_it_looked_in(run_cli: RunCli, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "job.yaml", "job:\n  entrypoint: t.py:main\n")
    code, err, _ = run_cli("ckpt", "ls", "--config", cfg)
    assert code == 2 and f"no run was found under '.phalanx/runs' (in {tmp_path})" in err, err
