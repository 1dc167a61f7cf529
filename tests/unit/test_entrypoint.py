"""Loading a job's entrypoint: a file entrypoint imports its sibling modules by name, as
the script would under ``python file.py``; bad entrypoints are typed config errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.runtime.worker.entrypoint import load_entrypoint


def test_a_file_entrypoint_imports_its_siblings(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))   # restored after the test
    (tmp_path / "helpers_for_entry_test.py").write_text("def twice(x):\n    return 2 * x\n")
    (tmp_path / "job.py").write_text("from helpers_for_entry_test import twice\n\n"
                                     "def main(x):\n    return twice(x)\n")
    try:
        assert load_entrypoint(f"{tmp_path / 'job.py'}:main")(21) == 42
        assert sys.path[0] == str(tmp_path.resolve())
    finally:
        sys.modules.pop("helpers_for_entry_test", None)


def test_bad_entrypoints_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("value = 1\n")
    with pytest.raises(ConfigError, match="not 'file.py:fn'"):
        load_entrypoint("job")
    with pytest.raises(ConfigError, match="script 'missing.py' does not exist"):
        load_entrypoint("missing.py")
    with pytest.raises(ConfigError, match="has no function 'value'"):
        load_entrypoint(f"{tmp_path / 'job.py'}:value")


def test_a_script_entrypoint_runs_as_main_with_its_argv(tmp_path: Path) -> None:
    """``job.entrypoint: train.py``: the file runs as ``__main__`` with ``job.argv`` as
    ``sys.argv[1:]`` (argparse sees them), its folder importable; ``sys.exit(0)`` is a
    normal end, another exit code an error; ``sys.argv`` is put back."""
    (tmp_path / "sibling_for_script_test.py").write_text("FACTOR = 3\n")
    out = tmp_path / "out.txt"
    (tmp_path / "train.py").write_text(
        "import argparse, sys\nfrom sibling_for_script_test import FACTOR\n"
        "p = argparse.ArgumentParser(); p.add_argument('--lr', type=float)\n"
        "p.add_argument('--exit', type=int, default=None)\n"
        f"a = p.parse_args()\nopen({str(out)!r}, 'w').write(f'{{__name__}} {{a.lr * FACTOR}}')\n"
        "if a.exit is not None: sys.exit(a.exit)\n")
    saved = list(sys.argv)
    try:
        run = load_entrypoint(str(tmp_path / "train.py"))
        assert run(argv=["--lr", "0.5"]) is None
        assert out.read_text() == "__main__ 1.5"
        assert run(argv=["--lr", "1", "--exit", "0"]) is None
        with pytest.raises(SystemExit):
            run(argv=["--lr", "1", "--exit", "3"])
        assert sys.argv == saved
    finally:
        sys.modules.pop("sibling_for_script_test", None)


def test_a_script_entrypoint_takes_argv_and_a_function_does_not() -> None:
    from phalanx.configs.schema import JobConfig

    assert JobConfig(entrypoint="train.py", argv=["--lr", "0.1"]).argv == ["--lr", "0.1"]
    with pytest.raises(ConfigError, match="job.argv: is set but job.entrypoint"):
        JobConfig(entrypoint="train.py:main", argv=["--lr", "0.1"])
    with pytest.raises(ConfigError, match="neither a script nor a function"):
        JobConfig(entrypoint="train")


def test_local_ranks_follow_torchrun_also_for_a_promoted_spare() -> None:
    from phalanx.launcher.coordination.coordinator import RankSlot
    from phalanx.launcher.job import assign_local_rank, local_world_size

    slots = {r: RankSlot(r, f"w{r}", r % 2, None) for r in range(4)}
    assert [assign_local_rank(slots, slots[r]) for r in range(4)] == [0, 0, 1, 1]
    assert [local_world_size(slots, slots[r]) for r in range(4)] == [2, 2, 2, 2]
    spare = RankSlot(1, "spare0", 0, None)       # rank 1 (node 1) promoted onto node 0
    assert assign_local_rank(slots, spare) == 2 and local_world_size(slots, spare) == 3
    slots[1] = spare
    back = RankSlot(2, "spare1", 0, None)        # rank 2 of node 0 replaced on node 0
    assert assign_local_rank(slots, back) == 1   # its index is free again


def test_phalanx_run_is_torchrun_shaped() -> None:
    from phalanx.launcher.cli import build_parser, run_overrides

    args = build_parser().parse_args(["run", "--nnodes", "2", "--nproc-per-node", "3",
                                      "--spares", "1", "my train.py", "--lr", "0.1", "-x"])
    assert run_overrides(args) == [
        'job.entrypoint="my train.py"', 'job.argv=["--lr", "0.1", "-x"]', "job.world_size=6",
        "job.nodes=2", "ray.virtual_nodes=2", "spares.count=1", 'job.name="my-train"']
    one = build_parser().parse_args(["run", "train.py"])
    assert "replication.factor=0" in run_overrides(one)     # one node: nowhere to replicate
    with pytest.raises(ConfigError, match="not a Python script"):
        run_overrides(build_parser().parse_args(["run", "train"]))


def test_the_entrypoints_source_is_found_for_scripts_files_and_modules(tmp_path: Path) -> None:
    from phalanx.runtime.worker.entrypoint import entry_source

    (tmp_path / "job.py").write_text("model = torch.compile(model)\n")
    assert entry_source(str(tmp_path / "job.py")) == "model = torch.compile(model)\n"
    assert entry_source(f"{tmp_path / 'job.py'}:main") == "model = torch.compile(model)\n"
    assert "def dumps" in entry_source("json:dumps")           # a module: its file
    assert entry_source("no_such_module_here:main") == ""
    assert entry_source(f"{tmp_path / 'missing.py'}:main") == ""


def test_a_worker_of_a_script_that_compiles_imports_the_compiler_before_it_is_promoted() -> None:
    """A promoted spare's ``torch.compile`` call spent 2.4 s importing inductor after the
    fault; a worker whose entrypoint calls it imports it at warm-up, the others do not."""
    from phalanx.spares.actor import _warm_compiler

    assert not _warm_compiler("model = DDP(model)\n")
    assert _warm_compiler("model = torch.compile(DDP(model))\n")
    assert "torch._inductor.compile_fx" in sys.modules
