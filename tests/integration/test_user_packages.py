"""phalanx installs one import name: a user project with its own ``configs`` and ``runtime``
packages (common in ML repositories) imports them inside a launched job, from the script's
folder, and never gets phalanx's. Launched from the user's project, as a user does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launching import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAIN = '''
import json, os
import torch
import configs.model
import runtime
import phalanx


def main(out: str, steps: int = 3) -> dict:
    session = phalanx.Session()
    torch.manual_seed(0)                 # data-parallel replicas start equal
    model = torch.nn.Linear(4, 1)
    session.register(model=model)
    with session:
        while session.step_index < steps:
            with session.step():
                model.weight.data.add_(1.0)
    record = {"rank": int(os.environ["RANK"]), "configs": configs.model.__file__,
              "model": configs.model.NAME, "runtime": runtime.__file__,
              "phalanx": phalanx.__file__}
    with open(os.path.join(out, f"rank{record['rank']}.json"), "w") as fh:
        json.dump(record, fh)
    return {}
'''


def test_a_users_configs_and_runtime_packages_import_inside_a_launched_job(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "__init__.py").write_text("")
    (project / "configs" / "model.py").write_text('NAME = "the user\'s model config"\n')
    (project / "runtime").mkdir()
    (project / "runtime" / "__init__.py").write_text('"""the user\'s runtime package"""\n')
    (project / "train.py").write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "launch", str(ROOT / "configs/demo.yaml")]
    for item in ("job.entrypoint=train.py:main", "job.world_size=2", "spares.count=0",
                 f"job.run_dir={tmp_path / 'runs'}", f"job.args={json.dumps({'out': str(out)})}"):
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["configs"] == str(project / "configs" / "model.py")
        assert record["model"] == "the user's model config"
        assert record["runtime"] == str(project / "runtime" / "__init__.py")
        assert Path(record["phalanx"]).resolve() == (ROOT / "__init__.py").resolve()
